# nix-darwin module: services.plimsoll.
#
# Declares the host line (RAM, OS floor, a budget per mode, transient reserve) and the
# model registry, writes the checked policy to /etc/plimsoll/policy.json, creates the
# admin token (at activation, if absent: root-owned, 0400, readable by the primary user
# through an ACL) and installs
#   - a launchd user agent running the proxy:
#       plimsoll serve --policy /etc/plimsoll/policy.json --admin-token-file TOKEN --mode M
#         [--cluster-rank C:T:B ...]   (cluster members serving a sharded model)
#   - a root launchd daemon running the link watcher:
#       plimsoll watch-link --policy /etc/plimsoll/policy.json --sysctl darwin --admin-token-file TOKEN
#     It sets `sysctl iogpu.wired_limit_mb` to the current mode's budget at load and on
#     every cluster-link change, and tells the proxy the mode (POST /admin/mode with the
#     shared token). nix-darwin has no sysctl option and re-runs no activation script at
#     boot, so a RunAtLoad daemon is what keeps the ceiling set.
# Every command line generated here passes `plimsoll <command> --check` in CI
# (python/tests/nix/test_darwin_commands.py runs them through the real CLI).
#
# The policy logic is pure builtins Nix (./policy.nix), shared with the flake's `lib`
# and the offline tests; this module only maps options onto it. A declaration that
# breaks a rule fails twice over: as failed `assertions` (one per broken rule, with the
# host, mode, budget, what it leaves and the floor), and when the policy text itself is
# read, since it is `builtins.toJSON` of the checked policy.
{ config, lib, pkgs, ... }:

let
  cfg = config.services.plimsoll;
  policyLib = import ./policy.nix;
  clusterLib = import ./cluster.nix;

  policyPath = "/etc/plimsoll/policy.json";

  # The declaration modules/policy.nix takes: the same names as the options below.
  declaration = {
    inherit (cfg) host totalRamGb osFloorGb transientReserve models settings;
    maxLocalLlmGb = { inherit (cfg.maxLocalLlmGb) standalone clustered; };
  };

  policyText = policyLib.policyJSON declaration;

  plimsoll = lib.getExe' cfg.package "plimsoll";

  # Cluster members serving a sharded model: one rank per member, this host first.
  clusterRankArgs = clusterLib.rankArgs declaration cfg.cluster.members;
  # The watcher tells the proxy the mode the link calls for; without it, a cluster
  # member's proxy starts (and stays) clustered.
  startMode = if clusterLib.isMember declaration && !cfg.watcher.enable then "clustered" else "standalone";

  serveArgs = [ plimsoll "serve" "--policy" policyPath "--admin-token-file" cfg.adminTokenFile
    "--mode" startMode ] ++ clusterRankArgs;
  watchArgs = [ plimsoll "watch-link" "--policy" policyPath "--sysctl" "darwin" ]
    ++ (if cfg.proxy.enable then [ "--admin-token-file" cfg.adminTokenFile ] else [ "--proxy" "none" ]);

  user = config.system.primaryUser;
  # Created once (a fresh random token), then only its owner, mode and ACL are re-asserted:
  # root-owned 0400, readable by the primary user's agent through an ACL entry.
  tokenScript = ''
    # plimsoll: the admin token the proxy (user agent) and the link watcher (root) share
    plimsollToken=${lib.escapeShellArg cfg.adminTokenFile}
    mkdir -p "$(dirname "$plimsollToken")"
    if [ ! -s "$plimsollToken" ]; then
      echo "plimsoll: creating the admin token $plimsollToken" >&2
      (umask 077 && od -An -vtx1 -N32 /dev/urandom | tr -d ' \n' >"$plimsollToken.new" \
        && mv -f "$plimsollToken.new" "$plimsollToken")
    fi
    chown root:wheel "$plimsollToken"
    chmod 0400 "$plimsollToken"
    chmod -N "$plimsollToken" 2>/dev/null || true
  '' + lib.optionalString (cfg.proxy.enable && user != null) ''
    chmod +a ${lib.escapeShellArg "user:${user} allow read"} "$plimsollToken"
  '';

  # Changes whenever the policy does, so nix-darwin reloads both services on a switch
  # (their ProgramArguments name the stable /etc path, not the store path).
  policyHash = builtins.hashString "sha256" policyText;

  # Ranges are left to the pure checks, whose messages name the host and the figures.
  gib = lib.types.number;

  modelOptions = { name, ... }: {
    options = with policyLib.modelDefaults; {
      path = lib.mkOption {
        type = lib.types.str;
        example = "/Users/Shared/models/Qwen3-30B-A3B-8bit";
        description = "Local model directory (config.json + safetensors), as mlx-lm loads it.";
      };
      context = lib.mkOption {
        type = lib.types.ints.positive;
        example = 32768;
        description = "Configured total context per sequence (prompt + output), in tokens.";
      };
      concurrency = lib.mkOption {
        type = lib.types.ints.positive;
        default = concurrency;
        description = "Requested concurrent sequences; admission may clamp it at load.";
      };
      defaultMaxTokens = lib.mkOption {
        type = lib.types.ints.positive;
        default = defaultMaxTokens;
        description = "Output reservation when a request names none (at most `maxTokens`).";
      };
      maxTokens = lib.mkOption {
        type = lib.types.ints.positive;
        default = maxTokens;
        description = "Largest output reservation a request may ask for (below `context`).";
      };
      kvDtype = lib.mkOption {
        type = lib.types.enum [ "auto" "float16" "bfloat16" "float32" "q8" "q4" ];
        default = kvDtype;
        description = "KV cache dtype; `auto` uses the model's; `q8`/`q4`: quantized KV (groups of 64, scales + biases).";
      };
      sharded = lib.mkOption {
        type = lib.types.bool;
        default = sharded;
        description = "Serve this model sharded across the cluster (clustered mode).";
      };
      idleTtlS = lib.mkOption {
        type = lib.types.ints.unsigned;
        default = idleTtlS;
        description = "Unload this model's worker after it has been idle this many seconds (0: never).";
      };
    };
  };
in
{
  options.services.plimsoll = {
    enable = lib.mkEnableOption "plimsoll, the memory-safe MLX serving stack (proxy agent, link-watcher daemon and /etc/plimsoll/policy.json)";

    package = lib.mkPackageOption pkgs "plimsoll" { };

    host = lib.mkOption {
      type = lib.types.strMatching "[A-Za-z0-9][A-Za-z0-9._-]{0,63}";
      default = if config.networking.hostName != null then config.networking.hostName else "localhost";
      defaultText = lib.literalExpression ''if config.networking.hostName != null then config.networking.hostName else "localhost"'';
      example = "studio";
      description = "Host name written to the policy (and named in every policy error).";
    };

    totalRamGb = lib.mkOption {
      type = gib;
      example = 96;
      description = "Physical RAM of this Mac, in GiB (Apple's \"96 GB\" is 96 GiB).";
    };

    osFloorGb = lib.mkOption {
      type = gib;
      example = 16;
      description = ''
        GiB that must always stay free for macOS and everything that is not an LLM
        worker. Each mode's budget must leave it: `totalRamGb − maxLocalLlmGb.<mode> ≥ osFloorGb`.
      '';
    };

    maxLocalLlmGb = {
      standalone = lib.mkOption {
        type = gib;
        example = 72;
        description = "GiB local LLM workers may use (weights + KV pool + reserve) when the host is alone.";
      };
      clustered = lib.mkOption {
        type = gib;
        default = cfg.maxLocalLlmGb.standalone;
        defaultText = lib.literalExpression "config.services.plimsoll.maxLocalLlmGb.standalone";
        example = 80;
        description = ''
          GiB local LLM workers may use while the cluster link is up (at least the
          standalone budget). The link watcher switches the wired ceiling between the two.
        '';
      };
    };

    transientReserve = lib.mkOption {
      type = lib.types.number;
      default = policyLib.defaults.transientReserve;
      example = 0.08;
      description = "Measured high-water transient allocations, as a fraction (0–0.5) of the mode budget.";
    };

    models = lib.mkOption {
      type = lib.types.attrsOf (lib.types.submodule modelOptions);
      default = { };
      example = lib.literalExpression ''
        {
          "qwen3-30b-a3b" = {
            path = "/Users/Shared/models/Qwen3-30B-A3B-8bit";
            context = 65536;
            concurrency = 2;
            maxTokens = 8192;
          };
        }
      '';
      description = "The model registry: name → local model directory and its serving settings.";
    };

    settings = lib.mkOption {
      type = lib.types.attrsOf lib.types.anything;
      default = { };
      example = lib.literalExpression ''
        {
          wire = "footprint";
          listen.port = 8080;
          cluster = {
            interface = "bridge0";
            backend = "ring";
            peers = [ { host = "studio-b"; address = "10.77.0.2"; } ];
          };
        }
      '';
      description = ''
        The rest of the policy, as in `plimsoll policy schema`: `tripOffset`, `uMargin`,
        `blockTokens`, `minContext`, `wire`, `listen`, `ollamaApi` (false: no Ollama API on
        the proxy's port), `cluster`, `pressure` (the proxy's memory-pressure tripwire).
        Unknown keys are errors.
      '';
    };

    adminTokenFile = lib.mkOption {
      type = lib.types.strMatching "/.+";
      default = "/var/db/plimsoll/admin-token";
      description = ''
        The admin token the proxy and the link watcher share (`--admin-token-file` of
        both): the watcher sends it with `POST /admin/mode`. Created at activation when
        absent (32 random bytes, hex), root-owned with mode 0400 and an ACL entry that lets
        `system.primaryUser` (whose agent runs the proxy) read it. Delete it and switch
        again to rotate it; restart both services afterwards.
      '';
    };

    cluster.members = lib.mkOption {
      type = lib.types.attrsOf (lib.types.attrsOf lib.types.anything);
      default = { };
      example = lib.literalExpression "import ./hosts   # every host declaration, by host name";
      description = ''
        Declarations of this host's cluster peers, by host name (the same plain attrsets
        as the services.plimsoll options, e.g. hosts/*.nix): each peer's `totalRamGb` and
        `maxLocalLlmGb.clustered` size its rank. A host with `settings.cluster.peers` and a
        model marked `sharded` gets one `--cluster-rank` per member (itself first); a peer
        missing here is a failed assertion. Extra entries are ignored.
      '';
    };

    proxy = {
      enable = lib.mkOption {
        type = lib.types.bool;
        default = true;
        description = "Run the proxy (`plimsoll serve`) as a launchd user agent of `system.primaryUser`.";
      };
      logFile = lib.mkOption {
        type = lib.types.str;
        # The primary user's home as nix-darwin's system.primaryUserHome computes it.
        default =
          let user = config.system.primaryUser; in
          if user != null
          then "${config.users.users.${user}.home or "/Users/${user}"}/Library/Logs/plimsoll-serve.log"
          else "/tmp/plimsoll-serve.log";
        defaultText = lib.literalExpression ''"''${config.system.primaryUserHome}/Library/Logs/plimsoll-serve.log"'';
        description = "Where the proxy agent's stdout and stderr go (must be writable by the user).";
      };
    };

    watcher = {
      enable = lib.mkOption {
        type = lib.types.bool;
        default = true;
        description = ''
          Run the link watcher (`plimsoll watch-link`) as a root launchd daemon: it sets
          `iogpu.wired_limit_mb` to the current mode's budget at load and on every link change.
        '';
      };
      logFile = lib.mkOption {
        type = lib.types.str;
        default = "/var/log/plimsoll-watch-link.log";
        description = "Where the link watcher's stdout and stderr go.";
      };
    };
  };

  config = lib.mkIf cfg.enable {
    # The pure checks, as nix-darwin assertions (one per rule the declaration breaks).
    assertions = map
      (c: { assertion = c.assertion; message = "services.plimsoll: ${c.message}"; })
      (policyLib.checks declaration
        ++ map (m: { assertion = false; message = m; }) (clusterLib.errors declaration cfg.cluster.members));

    system.activationScripts.extraActivation.text = tokenScript;

    environment.etc."plimsoll/policy.json".text = policyText;

    environment.systemPackages = [ cfg.package ];

    launchd.user.agents.plimsoll-serve = lib.mkIf cfg.proxy.enable {
      command = lib.escapeShellArgs serveArgs;
      environment.PLIMSOLL_POLICY_SHA256 = policyHash;
      serviceConfig = {
        RunAtLoad = true;
        KeepAlive = true;
        ProcessType = "Interactive";
        StandardOutPath = cfg.proxy.logFile;
        StandardErrorPath = cfg.proxy.logFile;
      };
      managedBy = "services.plimsoll.proxy.enable";
    };

    launchd.daemons.plimsoll-watch-link = lib.mkIf cfg.watcher.enable {
      command = lib.escapeShellArgs watchArgs;
      environment.PLIMSOLL_POLICY_SHA256 = policyHash;
      serviceConfig = {
        RunAtLoad = true;
        KeepAlive = true;
        ProcessType = "Interactive";
        StandardOutPath = cfg.watcher.logFile;
        StandardErrorPath = cfg.watcher.logFile;
      };
    };
  };
}
