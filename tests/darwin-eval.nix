# Test 4 (optional): modules/darwin.nix inside real nix-darwin (its eval-config.nix and
# every base module), with nixpkgs' lib and a stub pkgs. Nothing is built.
#
#   nix-instantiate --eval --strict --json tests/darwin-eval.nix \
#     --arg nixDarwinSrc "$NIX_DARWIN_SRC" --arg nixpkgsLib "$NIXPKGS_LIB" -A report
#
# tests/nix/run.sh does this when both variables name local snapshots, and skips
# otherwise. NIX_DARWIN_SRC: a nix-darwin checkout (holds eval-config.nix). NIXPKGS_LIB:
# a nixpkgs or nix-community/nixpkgs.lib checkout (holds lib/). Never commit them.
# Like tests/policy-eval.nix it yields { passed; failed; report; } (and `data`: what
# was inspected, for debugging).
{ nixDarwinSrc, nixpkgsLib }:
let
  lib = import (nixpkgsLib + "/lib");
  evalConfig = import (nixDarwinSrc + "/eval-config.nix");
  policy = import ../modules/policy.nix;
  hosts = import ../hosts;

  # A derivation-shaped attrset: enough for mkPackageOption, lib.getExe' and toPlist.
  fakeDrv = name:
    let
      self = {
        type = "derivation";
        inherit name;
        pname = name;
        version = "0";
        outPath = "/nix/store/00000000000000000000000000000000-${name}";
        drvPath = "/nix/store/00000000000000000000000000000000-${name}.drv";
        meta.mainProgram = name;
        outputs = [ "out" ];
        outputName = "out";
        out = self;
      };
    in
    self;

  stubPkgs = {
    plimsoll = fakeDrv "plimsoll";
    nix = fakeDrv "nix"; # nix-darwin's nix module reads pkgs.nix for its default
    lib = lib;
    stdenv = {
      hostPlatform = lib.systems.elaborate "aarch64-darwin";
      buildPlatform = lib.systems.elaborate "aarch64-darwin";
      shell = "/bin/sh";
      isDarwin = true;
    };
  };
  bin = "${stubPkgs.plimsoll}/bin/plimsoll";

  # A host declaration (plain data, as in hosts/) as nix-darwin configuration.
  hostModule = decl: extra: { lib, ... }: {
    imports = [ extra ];
    services.plimsoll = decl // { enable = lib.mkDefault true; cluster.members = lib.mkDefault hosts; };
    system.primaryUser = "alice";
    system.stateVersion = 6;
    nixpkgs.hostPlatform = "aarch64-darwin";
    # As nix-darwin's own lib.darwinSystem does when given `pkgs`.
    _module.args.pkgs = lib.mkForce stubPkgs;
  };

  evalFull = decl: extra: evalConfig {
    inherit lib;
    modules = [ ../modules/darwin.nix (hostModule decl extra) ];
  };
  evalWith = decl: extra: (evalFull decl extra).config;
  evalHost = decl: evalWith decl { };

  # What one module file defines for an option (the other modules' values stay unforced).
  definedBy = file: opt:
    builtins.concatLists (map (d: d.value)
      (builtins.filter (d: d.file == toString file) opt.definitionsWithLocations));

  # As nix-darwin does: a message is read only when its assertion fails.
  failedAssertions = config: map (a: a.message) (builtins.filter (a: !a.assertion) config.assertions);

  activateBeforeLaunchd = builtins.head (lib.splitString "activationScripts.launchd.text}"
    (builtins.readFile (nixDarwinSrc + "/modules/system/activation-scripts.nix")));

  shWrapped = args: [ "/bin/sh" "-c" "/bin/wait4path /nix/store && exec ${lib.concatStringsSep " " args}" ];

  token = "/var/db/plimsoll/admin-token";
  # What each example host's proxy agent is given beyond the policy and the token:
  # studio and studio-b are one cluster serving a sharded model (each host its own rank 0).
  expectedServeTail = {
    studio = [ "--mode" "standalone" "--cluster-backend" "ring" "--cluster-rank" "80:96:80" "--cluster-rank" "52:64:52" ];
    studio-b = [ "--mode" "standalone" "--cluster-backend" "ring" "--cluster-rank" "52:64:52" "--cluster-rank" "80:96:80" ];
    macbook = [ "--mode" "standalone" ];
  };

  hostCases = name: decl:
    let
      config = evalHost decl;
      agent = config.launchd.user.agents.plimsoll-serve.serviceConfig;
      daemon = config.launchd.daemons.plimsoll-watch-link.serviceConfig;
      text = config.environment.etc."plimsoll/policy.json".text;
      hash = builtins.hashString "sha256" text;
      agentPlist = config.environment.userLaunchAgents."org.nixos.plimsoll-serve.plist".text;
      daemonPlist = config.environment.launchDaemons."org.nixos.plimsoll-watch-link.plist".text;
    in
    [
      (eq "${name}: no failed assertions" (failedAssertions config) [ ])
      (eq "${name}: /etc/plimsoll/policy.json is the pure policy's JSON" text (policy.policyJSON decl))
      (eq "${name}: /etc/plimsoll/policy.json matches tests/expected/${name}.json"
        (builtins.fromJSON text) (builtins.fromJSON (builtins.readFile (./expected + "/${name}.json"))))
      (eq "${name}: agent runs plimsoll serve on the /etc policy with the shared token, after /nix/store is mounted"
        agent.ProgramArguments (shWrapped ([ bin "serve" "--policy" "/etc/plimsoll/policy.json"
          "--admin-token-file" token ] ++ expectedServeTail.${name})))
      (eq "${name}: agent serviceConfig"
        { inherit (agent) Label KeepAlive RunAtLoad ProcessType StandardOutPath StandardErrorPath; }
        {
          Label = "org.nixos.plimsoll-serve"; KeepAlive = true; RunAtLoad = true; ProcessType = "Interactive";
          StandardOutPath = "/Users/alice/Library/Logs/plimsoll-serve.log";
          StandardErrorPath = "/Users/alice/Library/Logs/plimsoll-serve.log";
        })
      (eq "${name}: daemon runs plimsoll watch-link on the /etc policy, the darwin sysctl and the shared token"
        daemon.ProgramArguments (shWrapped [ bin "watch-link" "--policy" "/etc/plimsoll/policy.json"
          "--sysctl" "darwin" "--admin-token-file" token ]))
      (ok "${name}: activation creates the token if absent (0400 root, ACL read for the primary user), before launchd loads the services"
        (let act = config.system.activationScripts.extraActivation.text; in
          lib.hasInfix "plimsollToken=${token}" act
          && lib.hasInfix ''if [ ! -s "$plimsollToken" ]'' act
          && lib.hasInfix ''chmod 0400 "$plimsollToken"'' act
          && lib.hasInfix ''chmod +a 'user:alice allow read' "$plimsollToken"'' act
          # nix-darwin's activate script runs extraActivation before the launchd jobs load
          && lib.hasInfix "extraActivation.text}" activateBeforeLaunchd))
      (eq "${name}: daemon serviceConfig (root: no UserName)"
        { inherit (daemon) Label KeepAlive RunAtLoad ProcessType StandardOutPath StandardErrorPath; UserName = daemon.UserName or null; }
        {
          Label = "org.nixos.plimsoll-watch-link"; KeepAlive = true; RunAtLoad = true; ProcessType = "Interactive";
          StandardOutPath = "/var/log/plimsoll-watch-link.log";
          StandardErrorPath = "/var/log/plimsoll-watch-link.log";
          UserName = null;
        })
      (eq "${name}: both services carry the policy hash (a policy change reloads them)"
        [ agent.EnvironmentVariables daemon.EnvironmentVariables ]
        [ { PLIMSOLL_POLICY_SHA256 = hash; } { PLIMSOLL_POLICY_SHA256 = hash; } ])
      (ok "${name}: the plists are rendered (agent in the user's LaunchAgents, daemon in LaunchDaemons)"
        (lib.hasInfix "<string>org.nixos.plimsoll-serve</string>" agentPlist
          && lib.hasInfix "<string>org.nixos.plimsoll-watch-link</string>" daemonPlist
          && lib.hasInfix "watch-link --policy /etc/plimsoll/policy.json --sysctl darwin" daemonPlist))
      (eq "${name}: the user agent is declared as needing system.primaryUser"
        (builtins.elem "services.plimsoll.proxy.enable" config.system.requiresPrimaryUser) true)
      (eq "${name}: the CLI is on the system PATH"
        (map (p: p.name) (definedBy ../modules/darwin.nix (evalFull decl { }).options.environment.systemPackages))
        [ "plimsoll" ])
    ];

  brokenDecl = import ./hosts/broken-mini.nix;
  brokenConfig = evalHost brokenDecl;

  disabled = evalWith hosts.studio { services.plimsoll.enable = false; };
  noPeers = evalWith hosts.studio { services.plimsoll.cluster.members = lib.mkForce { }; };
  noWatcher = evalWith hosts.studio { services.plimsoll.watcher.enable = false; };
  argsOf = svc: lib.splitString " " (lib.last svc.serviceConfig.ProgramArguments);
  oneWayPeer = evalWith hosts.studio {
    services.plimsoll.cluster.members = lib.mkForce { studio-b = removeAttrs hosts.studio-b [ "settings" ]; };
  };
  noProxy = evalWith hosts.studio { services.plimsoll.proxy.enable = false; };
  # Every cluster member declaring another backend (hosts without a cluster stay as they are).
  withBackend = b: decl:
    if (decl.settings or { }) ? cluster
    then decl // { settings = decl.settings // { cluster = decl.settings.cluster // { backend = b; }; }; }
    else decl;
  hostsOn = b: lib.mapAttrs (_: withBackend b) hosts;
  otherBackend = evalWith (withBackend "jaccl" hosts.studio) { };
  agentLine = cmds: name: lib.last cmds.${name}.jobs."agent:plimsoll-serve";
  hostFromNetworking = evalWith (removeAttrs hosts.macbook [ "host" ]) { networking.hostName = "mbp"; };

  eq = name: actual: expected: {
    inherit name;
    ok = actual == expected;
    detail = "got ${builtins.toJSON actual}, expected ${builtins.toJSON expected}";
  };
  ok = name: cond: { inherit name; ok = cond; detail = "false"; };

  cases =
    builtins.concatLists (lib.mapAttrsToList hostCases hosts)
    ++ readmeCases
    ++ [
      (ok "broken host: a failed assertion names host, mode, budget, what it leaves and the floor"
        (builtins.elem
          "services.plimsoll: host mini: standalone budget 60 GiB leaves 4 GiB, below the OS floor of 8 GiB: lower maxLocalLlmGb.standalone or osFloorGb"
          (failedAssertions brokenConfig)))
      (eq "broken host: only plimsoll's assertions fail"
        (builtins.all (lib.hasPrefix "services.plimsoll: ") (failedAssertions brokenConfig)) true)
      (eq "broken host: reading only the policy text throws"
        (builtins.tryEval brokenConfig.environment.etc."plimsoll/policy.json".text).success false)
      (eq "disabled: no policy file, no agent, no daemon, no assertions of ours"
        {
          etc = disabled.environment.etc ? "plimsoll/policy.json";
          agent = disabled.launchd.user.agents ? plimsoll-serve;
          daemon = disabled.launchd.daemons ? plimsoll-watch-link;
          failed = failedAssertions disabled;
        }
        { etc = false; agent = false; daemon = false; failed = [ ]; })
      (eq "proxy.enable = false: the daemon stays, manages the ceiling alone; the agent goes"
        { agent = noProxy.launchd.user.agents ? plimsoll-serve; daemon = noProxy.launchd.daemons ? plimsoll-watch-link;
          proxyNone = lib.hasSuffix "--sysctl darwin --proxy none" (lib.last noProxy.launchd.daemons.plimsoll-watch-link.serviceConfig.ProgramArguments); }
        { agent = false; daemon = true; proxyNone = true; })
      (eq "cluster member without its peer's declaration: a failed assertion naming the peer, no ranks"
        [ (failedAssertions noPeers) (builtins.elem "--cluster-rank" (argsOf noPeers.launchd.user.agents.plimsoll-serve)) ]
        [ [ "services.plimsoll: host studio: cluster peer studio-b has no declaration: add it to services.plimsoll.cluster.members (its totalRamGb and maxLocalLlmGb.clustered size its rank)" ] false ])
      (eq "cluster peer that does not list this host back: a failed assertion"
        (failedAssertions oneWayPeer)
        [ "services.plimsoll: host studio: cluster peer studio-b does not list studio among its own settings.cluster.peers: declare the link on both hosts" ])
      (eq "cluster peer declaring another backend: a failed assertion naming both"
        (failedAssertions otherBackend)
        [ "services.plimsoll: host studio: cluster peer studio-b declares settings.cluster.backend \"ring\", this host \"jaccl\": one cluster runs on one backend, declare the same on both hosts" ])
      (ok "two cluster members on nccl: both generated commands carry --cluster-backend nccl before their ranks"
        (lib.hasSuffix "--cluster-backend nccl --cluster-rank 80:96:80 --cluster-rank 52:64:52" (agentLine backendCommands.nccl "studio")
          && lib.hasSuffix "--cluster-backend nccl --cluster-rank 52:64:52 --cluster-rank 80:96:80" (agentLine backendCommands.nccl "studio-b")
          && !(lib.hasInfix "--cluster-backend" (agentLine backendCommands.nccl "macbook"))))
      (ok "cluster member without the watcher: its proxy starts clustered (nothing would switch it)"
        (lib.hasInfix "--mode clustered --cluster-backend ring --cluster-rank 80:96:80" (lib.last noWatcher.launchd.user.agents.plimsoll-serve.serviceConfig.ProgramArguments)))
      (eq "host defaults to networking.hostName"
        (builtins.fromJSON hostFromNetworking.environment.etc."plimsoll/policy.json".text).host "mbp")
      (eq "clustered budget defaults to the standalone one (macbook)"
        (builtins.fromJSON (evalHost hosts.macbook).environment.etc."plimsoll/policy.json".text).modes.clustered
        { maxLocalLlmGb = 24; })
    ];

  # The README's "On a Mac with nix-darwin" example, evaluated as written: its flake's
  # outputs are called with nix-darwin's darwinSystem (the real eval-config) and this
  # repository's module; it must describe the studio host exactly.
  readme = builtins.readFile ../README.md;
  readmeFlakeText =
    let
      section = builtins.elemAt (lib.splitString "### On a Mac with nix-darwin" readme) 1;
      block = builtins.elemAt (lib.splitString "```" section) 1;
    in
    lib.replaceStrings [ "./hosts/" ] [ "${toString ../hosts}/" ] (lib.removePrefix "nix\n" block);
  readmeFlake = import (builtins.toFile "readme-flake.nix" readmeFlakeText);
  readmeSystem = (readmeFlake.outputs {
    nix-darwin.lib.darwinSystem = { modules }: evalConfig {
      inherit lib;
      modules = modules ++ [ { _module.args.pkgs = lib.mkForce stubPkgs; } ];
    };
    plimsoll.darwinModules.default = ../modules/darwin.nix;
  }).darwinConfigurations.studio.config;
  readmeCases = [
    (eq "README example: no failed assertions" (failedAssertions readmeSystem) [ ])
    (eq "README example: its policy is hosts/studio.nix's (tests/expected/studio.json)"
      (builtins.fromJSON readmeSystem.environment.etc."plimsoll/policy.json".text)
      (builtins.fromJSON (builtins.readFile ./expected/studio.json)))
    (eq "README example: the agent's command is the one the README shows"
      (lib.last readmeSystem.launchd.user.agents.plimsoll-serve.serviceConfig.ProgramArguments)
      "/bin/wait4path /nix/store && exec ${bin} serve --policy /etc/plimsoll/policy.json --admin-token-file /var/db/plimsoll/admin-token --mode standalone --cluster-backend ring --cluster-rank 80:96:80 --cluster-rank 52:64:52")
    (ok "README example: the README shows the daemon's command as generated"
      (lib.hasInfix (lib.removePrefix "/bin/wait4path /nix/store && exec ${bin} " (lib.last readmeSystem.launchd.daemons.plimsoll-watch-link.serviceConfig.ProgramArguments)) readme))
  ];

  results = map (c: { inherit (c) name ok; detail = if c.ok then "" else c.detail; }) cases;
  passed = builtins.length (builtins.filter (r: r.ok) results);
  failed = builtins.length (builtins.filter (r: !r.ok) results);
  report = lib.concatStringsSep "\n"
    (map (r: if r.ok then "ok   ${r.name}" else "FAIL ${r.name}: ${r.detail}") results
      ++ [ "${toString passed} passed, ${toString failed} failed" ]) + "\n";
  # For python/tests/nix/test_darwin_commands.py: every launchd job this module generates, per
  # host, with the files its arguments name (the policy text, the token path).
  # ``backendCommands.B``: the same, every cluster member declaring backend B.
  commandsOf = hs: lib.mapAttrs (name: decl:
    let config = evalWith decl { services.plimsoll.cluster.members = lib.mkForce hs; }; in {
      policy = config.environment.etc."plimsoll/policy.json".text;
      adminTokenFile = config.services.plimsoll.adminTokenFile;
      activation = config.system.activationScripts.extraActivation.text;
      plimsoll = bin;
      jobs =
        lib.mapAttrs' (n: v: lib.nameValuePair "agent:${n}" v.serviceConfig.ProgramArguments)
          (lib.filterAttrs (n: _: lib.hasPrefix "plimsoll" n) config.launchd.user.agents)
        // lib.mapAttrs' (n: v: lib.nameValuePair "daemon:${n}" v.serviceConfig.ProgramArguments)
          (lib.filterAttrs (n: _: lib.hasPrefix "plimsoll" n) config.launchd.daemons);
    }) hs;
  commands = commandsOf hosts;
  backendCommands = lib.genAttrs [ "auto" "ring" "jaccl" "nccl" ] (b: commandsOf (hostsOn b));
in
{
  inherit passed failed report results commands backendCommands;
}
