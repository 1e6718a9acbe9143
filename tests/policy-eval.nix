# Offline tests of the pure policy (modules/policy.nix), builtins only.
#
#   nix-instantiate --eval --strict --json tests/policy-eval.nix       # { passed; failed; report; results; }
#   nix eval --raw --file tests/policy-eval.nix report                 # one line per test + "N passed, N failed"
#
# tests/nix/run.sh prints the report and fails unless `failed` is 0.
# Each broken declaration must (a) make checkedPolicy throw (forced through
# builtins.toJSON, as /etc/plimsoll/policy.json is) and (b) report its exact named
# message (a prefix of it, for the long ones) among `errors`. run.sh also checks the
# thrown text itself on stderr, which builtins.tryEval cannot see.
let
  inherit (builtins) all any attrNames concatStringsSep filter fromJSON length map readFile
    stringLength substring toJSON tryEval;

  policy = import ../modules/policy.nix;
  hosts = import ../hosts;
  studio = hosts.studio;
  macbook = hosts.macbook;

  hasPrefix = pre: s: substring 0 (stringLength pre) s == pre;

  # Nix before 2.19 writes floats with 6 significant digits; later versions keep them all.
  lossyFloats = toJSON 0.1234567 != "0.1234567";

  # ---- the cases ---------------------------------------------------------------------------

  equal = name: actual: expected: {
    inherit name;
    ok = actual == expected;
    detail = "got ${toJSON actual}, expected ${toJSON expected}";
  };

  # A broken declaration: the JSON text must throw, and `errors` must name the problem.
  broken = name: decl: expectedPrefix:
    let
      forced = tryEval (policy.policyJSON decl);
      errs = policy.errors decl;
      named = any (hasPrefix expectedPrefix) errs;
    in
    {
      inherit name decl;
      expectValid = false;
      mirrored = true;
      ok = !forced.success && named;
      detail =
        if forced.success then "did not throw"
        else "no error starts with ${toJSON expectedPrefix}; errors: ${toJSON errs}";
    };

  # Accepted: no errors, and the JSON text forces.
  accepted = name: decl:
    let errs = policy.errors decl; in {
      inherit name decl;
      expectValid = true;
      mirrored = true;
      ok = errs == [ ] && (tryEval (policy.policyJSON decl)).success;
      detail = "errors: ${toJSON errs}";
    };

  # A rule about the declaration itself, which the JSON cannot show (a misspelt key is
  # dropped, a float 16.0 is written 16): Python has nothing to refuse there.
  nixOnly = c: c // { mirrored = false; };

  withModel = decl: name: entry: decl // { models = (decl.models or { }) // { ${name} = entry; }; };
  withSettings = decl: s: decl // { settings = (decl.settings or { }) // s; };
  smallModel = studio.models."qwen3-0.6b";

  minimal = { host = "min"; totalRamGb = 16; osFloorGb = 4; maxLocalLlmGb.standalone = 8; };

  cases = [
    # -- example hosts yield the expected JSON ----------------------------------------------
    (equal "studio yields tests/expected/studio.json"
      (policy.checkedPolicy studio) (fromJSON (readFile ./expected/studio.json)))
    (equal "macbook yields tests/expected/macbook.json"
      (policy.checkedPolicy macbook) (fromJSON (readFile ./expected/macbook.json)))
    (equal "the JSON text round-trips to the same policy (studio)"
      (fromJSON (policy.policyJSON studio)) (policy.checkedPolicy studio))
    (equal "the JSON text round-trips to the same policy (macbook)"
      (fromJSON (policy.policyJSON macbook)) (policy.checkedPolicy macbook))
    (equal "every example host has no errors"
      (map (h: policy.errors hosts.${h}) (attrNames hosts)) (map (_: [ ]) (attrNames hosts)))
    (equal "macbook: no clustered budget declared, clustered = standalone"
      (policy.checkedPolicy macbook).modes { standalone.maxLocalLlmGb = 24; clustered.maxLocalLlmGb = 24; })
    (equal "studio: budgets are GiB, unchanged"
      (policy.checkedPolicy studio).modes { standalone.maxLocalLlmGb = 72; clustered.maxLocalLlmGb = 80; })
    (equal "a minimal declaration gets every default (the pydantic defaults)"
      (policy.checkedPolicy minimal)
      {
        schemaVersion = 1; host = "min"; totalRamGb = 16; osFloorGb = 4;
        modes = { standalone.maxLocalLlmGb = 8; clustered.maxLocalLlmGb = 8; };
        transientReserve = 0.05; tripOffset = 0.05; uMargin = 0.02; blockTokens = 16;
        minContext = 2048; wire = "weights";
        listen = { host = "127.0.0.1"; port = 8080; }; ollamaApi = true;
        cluster = { interface = "bridge0"; peers = [ ]; backend = "auto"; };
        pressure = {
          enabled = true; someAvg10Warn = 10; someAvg10Critical = 25; fullAvg10Critical = 5;
          pageOutsPerS = 256; darwinLevel = "warn"; pollS = 1; clearAfterS = 10;
        };
        diskCache = null; aliases = { }; defaultModel = null;
        models = { };
      })
    (equal "a model entry gets the pydantic defaults"
      (policy.checkedPolicy (withModel minimal "m" { path = "/m"; context = 8192; })).models.m
      { path = "/m"; context = 8192; concurrency = 1; defaultMaxTokens = 512; maxTokens = 4096; kvDtype = "auto"; sharded = false; idleTtlS = 300; diskCache = null; maxTokensOverLimit = "clamp"; promptLookup = 0; numDraftTokens = 3; mtp = true; draftModel = null; })
    (equal "a partial listen keeps the default host"
      (policy.checkedPolicy (withSettings minimal { listen.port = 9000; })).listen { host = "127.0.0.1"; port = 9000; })
    (equal "a partial pressure block keeps the other defaults"
      (policy.checkedPolicy (withSettings minimal { pressure = { pollS = 0.5; clearAfterS = 30; }; })).pressure
      { enabled = true; someAvg10Warn = 10; someAvg10Critical = 25; fullAvg10Critical = 5; pageOutsPerS = 256; darwinLevel = "warn"; pollS = 0.5; clearAfterS = 30; })
    (accepted "pressure: every field set, tripwire off, warn = critical, no hold"
      (withSettings minimal { pressure = { enabled = false; someAvg10Warn = 20; someAvg10Critical = 20; fullAvg10Critical = 100; pageOutsPerS = 0.5; darwinLevel = "critical"; pollS = 60; clearAfterS = 0; }; }))
    (equal "GiB to bytes: 72 GiB" (policy.gibToBytes 72) 77309411328)
    (equal "GiB to bytes: 0.5 GiB" (policy.gibToBytes 0.5) 536870912)
    (equal "numbers read as written" (map policy.fmt [ 60 4.5 (96 - 91.9) (-4) 60.0 ]) [ "60" "4.5" "4.1" "-4" "60" ])
    (accepted "budget exactly at the floor is allowed (96 − 80 = 16)"
      (studio // { maxLocalLlmGb = { standalone = 72; clustered = 80; }; }))
    (accepted "fractional budgets are fine" (minimal // { maxLocalLlmGb.standalone = 11.5; osFloorGb = 4.5; }))
    (accepted "an OS floor of 0 is allowed" (minimal // { osFloorGb = 0; maxLocalLlmGb.standalone = 16; }))

    # -- broken declarations throw with their named message ----------------------------------
    (broken "the broken host under tests/ (standalone eats the floor)" (import ./hosts/broken-mini.nix)
      "host mini: standalone budget 60 GiB leaves 4 GiB, below the OS floor of 8 GiB")
    (broken "clustered budget eats the floor" (studio // { maxLocalLlmGb = { standalone = 72; clustered = 90; }; })
      "host studio: clustered budget 90 GiB leaves 6 GiB, below the OS floor of 16 GiB: lower maxLocalLlmGb.clustered or osFloorGb")
    (broken "fractional figures are named as written" (macbook // { maxLocalLlmGb.standalone = 27.5; })
      "host macbook: standalone budget 27.5 GiB leaves 8.5 GiB, below the OS floor of 10 GiB")
    (broken "a budget above the RAM leaves a negative figure" (minimal // { maxLocalLlmGb.standalone = 20; })
      "host min: standalone budget 20 GiB leaves -4 GiB, below the OS floor of 4 GiB")
    (broken "clustered below standalone" (studio // { maxLocalLlmGb = { standalone = 72; clustered = 60; }; })
      "host studio: clustered budget 60 GiB is below the standalone budget of 72 GiB")
    (broken "standalone budget is required" (minimal // { maxLocalLlmGb = { clustered = 8; }; })
      "host min: maxLocalLlmGb.standalone is required")
    (nixOnly (broken "unknown mode" (minimal // { maxLocalLlmGb = { standalone = 8; solo = 4; }; })
      "host min: maxLocalLlmGb has unknown mode(s) \"solo\""))
    (broken "a zero budget" (minimal // { maxLocalLlmGb.standalone = 0; })
      "host min: maxLocalLlmGb.standalone is 0, must be at least 1 MiB (0.0009765625 GiB)")
    (broken "a budget under 1 MiB" (minimal // { maxLocalLlmGb.standalone = 0.0001; })
      "host min: maxLocalLlmGb.standalone is 0.0001, must be at least 1 MiB")
    (broken "a budget that is not a number" (minimal // { maxLocalLlmGb.standalone = "8"; })
      "host min: maxLocalLlmGb.standalone must be a number, got \"8\"")
    (broken "totalRamGb missing" (removeAttrs minimal [ "totalRamGb" ])
      "host min: totalRamGb must be a number, got a null")
    (broken "a negative OS floor" (minimal // { osFloorGb = -1; })
      "host min: osFloorGb is -1, must be at least 0 GiB")
    (broken "transientReserve above 0.5" (studio // { transientReserve = 0.7; })
      "host studio: transientReserve is 0.7, must be between 0 and 0.5")
    (broken "tripOffset of 0" (withSettings minimal { tripOffset = 0; })
      "host min: settings.tripOffset is 0, must be above 0 and at most 0.2")
    (broken "uMargin above 0.2" (withSettings minimal { uMargin = 0.3; })
      "host min: settings.uMargin is 0.3, must be above 0 and at most 0.2")
    (nixOnly (broken "blockTokens as a float" (withSettings minimal { blockTokens = 16.0; })
      "host min: settings.blockTokens must be an integer, got the float 16"))
    (broken "blockTokens above 4096" (withSettings minimal { blockTokens = 8192; })
      "host min: settings.blockTokens is 8192, must be between 1 and 4096 tokens")
    (broken "minContext below 16" (withSettings minimal { minContext = 8; })
      "host min: settings.minContext is 8, must be at least 16 tokens")
    (broken "wire not a choice" (withSettings minimal { wire = "all"; })
      "host min: settings.wire is \"all\", must be one of \"footprint\", \"weights\", \"none\"")
    (accepted "Ollama's API turned off" (withSettings minimal { ollamaApi = false; }))
    (broken "ollamaApi not a boolean" (withSettings minimal { ollamaApi = "no"; })
      "host min: settings.ollamaApi must be true or false, got \"no\"")
    (broken "listen port out of range" (withSettings minimal { listen.port = 70000; })
      "host min: settings.listen.port is 70000, must be between 1 and 65535")
    (broken "unknown listen key" (withSettings minimal { listen.address = "0.0.0.0"; })
      "host min: settings.listen has unknown key(s) \"address\"")
    (broken "cluster backend not a choice" (withSettings minimal { cluster.backend = "mpi"; })
      "host min: settings.cluster.backend is \"mpi\", must be one of \"auto\", \"ring\", \"jaccl\", \"nccl\"")
    (broken "cluster peer with a bad name" (withSettings minimal { cluster.peers = [ { host = "-bad"; address = "10.0.0.2"; } ]; })
      "host min: settings.cluster.peers[0].host is \"-bad\"")
    (broken "cluster peer without an address" (withSettings minimal { cluster.peers = [ { host = "b"; } ]; })
      "host min: settings.cluster.peers[0].address must be a non-empty string")
    (broken "pressure: warn line above the critical one" (withSettings minimal { pressure = { someAvg10Warn = 30; }; })
      "host min: settings.pressure.someAvg10Warn (30) is above settings.pressure.someAvg10Critical (25): lower the warn line or raise the critical one")
    (broken "pressure: a PSI line above 100 %" (withSettings minimal { pressure.fullAvg10Critical = 101; })
      "host min: settings.pressure.fullAvg10Critical is 101, must be above 0 and at most 100")
    (broken "pressure: a zero warn line" (withSettings minimal { pressure.someAvg10Warn = 0; })
      "host min: settings.pressure.someAvg10Warn is 0, must be above 0 and at most 100")
    (broken "pressure: a zero page-out rate" (withSettings minimal { pressure.pageOutsPerS = 0; })
      "host min: settings.pressure.pageOutsPerS is 0, must be above 0 pages per second")
    (broken "pressure: pollS of 0" (withSettings minimal { pressure.pollS = 0; })
      "host min: settings.pressure.pollS is 0, must be above 0 and at most 60 seconds")
    (broken "pressure: a negative clearAfterS" (withSettings minimal { pressure.clearAfterS = -1; })
      "host min: settings.pressure.clearAfterS is -1, must be between 0 and 3600 seconds")
    (broken "pressure: darwinLevel not a choice" (withSettings minimal { pressure.darwinLevel = "urgent"; })
      "host min: settings.pressure.darwinLevel is \"urgent\", must be one of \"warn\", \"critical\"")
    (broken "pressure: enabled not a bool" (withSettings minimal { pressure.enabled = "yes"; })
      "host min: settings.pressure.enabled must be true or false, got \"yes\"")
    (broken "pressure: an unknown key" (withSettings minimal { pressure.someAvg60Warn = 5; })
      "host min: settings.pressure has unknown key(s) \"someAvg60Warn\"")
    (nixOnly (broken "a typed field in settings" (withSettings minimal { totalRamGb = 32; })
      "host min: settings has unknown key(s) \"totalRamGb\""))
    (nixOnly (broken "a misspelt declaration key" (minimal // { osFloorGB = 4; })
      "host min: unknown declaration key(s) \"osFloorGB\""))
    (broken "a host name with a space" (minimal // { host = "my mac"; })
      "host name \"my mac\" must match")
    (broken "model: maxTokens not below context" (withModel studio "qwen3-0.6b" (smallModel // { context = 4096; }))
      "host studio: model qwen3-0.6b: maxTokens (4096) must be below context (4096)")
    (broken "model: defaultMaxTokens above maxTokens" (withModel studio "qwen3-0.6b" (smallModel // { defaultMaxTokens = 8192; }))
      "host studio: model qwen3-0.6b: defaultMaxTokens (8192) exceeds maxTokens (4096): lower defaultMaxTokens")
    (broken "model: default maxTokens (4096) must fit a small context" (withModel minimal "m" { path = "/m"; context = 2048; })
      "host min: model m: maxTokens (4096) must be below context (2048)")
    (broken "model: context missing" (withModel minimal "m" { path = "/m"; })
      "host min: model m: context is required")
    (broken "model: context below 256" (withModel minimal "m" { path = "/m"; context = 100; maxTokens = 50; defaultMaxTokens = 50; })
      "host min: model m: context is 100, must be between 256 and 4194304 tokens")
    (broken "model: concurrency 0" (withModel minimal "m" { path = "/m"; context = 8192; concurrency = 0; })
      "host min: model m: concurrency is 0, must be between 1 and 1024")
    (broken "model: empty path" (withModel minimal "m" { path = ""; context = 8192; })
      "host min: model m: path must be a non-empty string")
    (broken "model: kvDtype not a choice" (withModel minimal "m" { path = "/m"; context = 8192; kvDtype = "int8"; })
      "host min: model m: kvDtype is \"int8\", must be one of")
    (broken "model: an empty draftModel" (withModel minimal "m" { path = "/m"; context = 8192; draftModel = ""; })
      "host min: model m: draftModel must be null (off) or a non-empty string")
    (equal "model: a draftModel is kept"
      (policy.checkedPolicy (withModel minimal "m" { path = "/m"; context = 8192; draftModel = "org/small"; })).models.m.draftModel
      "org/small")
    (broken "model: unknown key" (withModel minimal "m" { path = "/m"; context = 8192; ctx = 1; })
      "host min: model m has unknown key(s) \"ctx\"")
    (broken "model: a bad name" (withModel minimal "bad name!" { path = "/m"; context = 8192; })
      "host min: model name \"bad name!\" must match")
    (broken "every error is reported, not just the first"
      ((import ./hosts/broken-mini.nix) // { transientReserve = 0.9; })
      "host mini: transientReserve is 0.9")
  ]
  ++ (if lossyFloats then [
    (nixOnly (broken "a float this Nix cannot write exactly to JSON (Nix < 2.19)" (minimal // { totalRamGb = 16.1234567; })
      "host min: totalRamGb is 16.123457 with more precision than this Nix writes to JSON"))
  ] else [
    (accepted "a float with many digits survives JSON (Nix ≥ 2.19)" (minimal // { totalRamGb = 16.1234567; }))
  ]);

  results = map (c: { inherit (c) name ok; detail = if c.ok then "" else c.detail; }) cases;
  passed = length (filter (r: r.ok) results);
  failed = length (filter (r: !r.ok) results);
  report = concatStringsSep "\n"
    (map (r: if r.ok then "ok   ${r.name}" else "FAIL ${r.name}: ${r.detail}") results
      ++ [ "${toString passed} passed, ${toString failed} failed" ]) + "\n";
  # For python/tests/nix/test_nix_policy.py: every declaration case as the (unchecked)
  # policy it would write, and whether Python must accept or refuse that JSON too.
  mirror = map
    (c: { inherit (c) name expectValid; policy = policy.policyOf c.decl; })
    (filter (c: c ? decl && c.mirrored) cases);
in
{
  inherit passed failed report results mirror;
}
