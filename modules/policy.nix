# The host policy, in pure builtins Nix (no nixpkgs): a host declaration in, the
# policy attrset that /etc/plimsoll/policy.json holds out, plus the checks.
#
# This file is the Nix half of a contract whose Python half is
# python/plimsoll/core/policy.py and the committed JSON Schema
# python/plimsoll/core/policy.schema.json. Same field names (camelCase), same units
# (every *Gb is GiB, × 1024³), same defaults, same rules:
#   - each mode's budget leaves the OS floor free: totalRamGb − maxLocalLlmGb ≥ osFloorGb;
#   - the clustered budget is at least the standalone one;
#   - fractions in range (transientReserve ∈ [0, 0.5], tripOffset, uMargin ∈ (0, 0.2]);
#   - the pressure tripwire's lines in range, its warn line not above its critical one;
#   - every model entry well-formed (defaultMaxTokens ≤ maxTokens < context, …);
#   - no unknown keys anywhere (a typo is an error, never a silent default).
# python/tests/nix/test_nix_policy.py proves the two halves agree on every field.
#
# A host declaration (hosts/*.nix, or services.plimsoll.* in the nix-darwin module):
#   {
#     host = "studio";                       # policy "host", name pattern as in Python
#     totalRamGb = 96;                        # GiB
#     osFloorGb = 16;                         # GiB always left to the OS
#     maxLocalLlmGb = { standalone = 72; clustered = 80; };  # clustered defaults to standalone
#     transientReserve = 0.05;                # fraction of the mode budget (optional)
#     models = { name = { path = "..."; context = 32768; ... }; };   # optional
#     settings = { wire = "weights"; listen.port = 8080; cluster = { ... };     # optional
#                  pressure = { someAvg10Warn = 10; clearAfterS = 10; ... }; };
#   }
#
# Entry points:
#   policyOf decl      the policy attrset, every field explicit (unchecked)
#   checks decl        [ { assertion = bool; message = str; } ] — nix-darwin `assertions` shape
#   errors decl        the messages of the failing checks
#   checkedPolicy decl the policy, or a throw listing every error
#   policyJSON decl    builtins.toJSON of checkedPolicy
let
  inherit (builtins)
    all attrNames concatStringsSep elem filter floor fromJSON genList hasAttr
    isAttrs isBool isFloat isInt isList isString length listToAttrs map mapAttrs
    match removeAttrs toJSON toString typeOf;

  schemaVersion = 1;

  # Defaults: identical to the pydantic models' defaults (python/plimsoll/core/policy.py);
  # the Python test compares them field by field.
  defaults = {
    transientReserve = 0.05;
    tripOffset = 0.05;
    uMargin = 0.02;
    blockTokens = 16;
    minContext = 2048;
    wire = "weights";
    listen = { host = "127.0.0.1"; port = 8080; };
    ollamaApi = true;  # Ollama's API (/api/*) on the proxy's port
    cluster = { interface = "bridge0"; peers = [ ]; backend = "auto"; };
    # The proxy's memory-pressure tripwire (PSI %, pages/s, seconds).
    pressure = {
      enabled = true;
      someAvg10Warn = 10;
      someAvg10Critical = 25;
      fullAvg10Critical = 5;
      pageOutsPerS = 256;
      darwinLevel = "warn";
      pollS = 1;
      clearAfterS = 10;
    };
  };

  modelDefaults = {
    concurrency = 1;
    defaultMaxTokens = 512;
    maxTokens = 4096;
    kvDtype = "auto";
    sharded = false;
    idleTtlS = 300;
    diskCache = null;
    maxTokensOverLimit = "clamp";
    promptLookup = 0;
    numDraftTokens = 3;
    mtp = true;
    draftModel = null;
  };

  # The disk tier for KV blocks (host-wide in settings, or per model): off when null.
  diskCacheDefaults = { maxGb = 10; };
  diskCacheOf = d: if isAttrs d then diskCacheDefaults // d else d;

  declKeys = [ "host" "totalRamGb" "osFloorGb" "maxLocalLlmGb" "transientReserve" "models" "settings" "aliases" "defaultModel" ];
  modeNames = [ "standalone" "clustered" ];
  settingsKeys = [ "tripOffset" "uMargin" "blockTokens" "minContext" "wire" "listen" "ollamaApi" "cluster" "pressure" "diskCache" ];
  modelKeys = [ "path" "context" "concurrency" "defaultMaxTokens" "maxTokens" "kvDtype" "sharded" "idleTtlS" "diskCache" "maxTokensOverLimit" "promptLookup" "numDraftTokens" "mtp" "draftModel" ];
  listenKeys = [ "host" "port" ];
  clusterKeys = [ "interface" "peers" "backend" ];
  peerKeys = [ "host" "address" ];
  pressureKeys = attrNames defaults.pressure;
  darwinLevels = [ "warn" "critical" ];
  wireChoices = [ "footprint" "weights" "none" ];
  kvDtypes = [ "auto" "float16" "bfloat16" "float32" "q8" "q4" ];
  backends = [ "auto" "ring" "jaccl" "nccl" ];

  # ---- small helpers (builtins only) -------------------------------------------------

  isNum = x: isInt x || isFloat x;
  isName = x: isString x && match "[A-Za-z0-9][A-Za-z0-9._-]{0,63}" x != null;

  # Numbers as a person writes them: 60, 4.5, -4 (toString of a float gives "4.500000").
  fmt = x:
    if isInt x then toString x
    else if isFloat x then
      let
        s = toString x;
        withFrac = match "(-?[0-9]+)\\.([0-9]*[1-9])0*" s;
        whole = match "(-?[0-9]+)\\.0*" s;
      in
      if withFrac != null then "${builtins.elemAt withFrac 0}.${builtins.elemAt withFrac 1}"
      else if whole != null then builtins.head whole
      else s
    else if isString x then "\"${x}\""
    else if isBool x then (if x then "true" else "false")
    else "a ${typeOf x}";

  quoteList = xs: concatStringsSep ", " (map (x: "\"${x}\"") xs);

  # Nix before 2.19 writes floats to JSON with 6 significant digits: a value that does
  # not survive the trip would make Nix and Python disagree, so it is an error.
  survivesJSON = x: !(isFloat x) || fromJSON (toJSON x) == x;

  unknownKeys = allowed: set: filter (k: !(elem k allowed)) (attrNames set);

  check = assertion: message: { inherit assertion message; };

  # ---- the policy attrset --------------------------------------------------------------

  modesOf = decl:
    let
      m = decl.maxLocalLlmGb or { };
      standalone = m.standalone or null;
    in
    {
      standalone = { maxLocalLlmGb = standalone; };
      clustered = { maxLocalLlmGb = m.clustered or standalone; };
    };

  modelOf = entry: let e = modelDefaults // entry; in e // { diskCache = diskCacheOf e.diskCache; };

  policyOf = decl:
    let
      settings = decl.settings or { };
      s = if isAttrs settings then settings else { };
      listen = defaults.listen // (if isAttrs (s.listen or { }) then s.listen or { } else { });
      cluster = defaults.cluster // (if isAttrs (s.cluster or { }) then s.cluster or { } else { });
      pressure = defaults.pressure // (if isAttrs (s.pressure or { }) then s.pressure or { } else { });
      models = decl.models or { };
    in
    {
      inherit schemaVersion;
      host = decl.host or null;
      totalRamGb = decl.totalRamGb or null;
      osFloorGb = decl.osFloorGb or null;
      modes = modesOf decl;
      transientReserve = decl.transientReserve or defaults.transientReserve;
      tripOffset = s.tripOffset or defaults.tripOffset;
      uMargin = s.uMargin or defaults.uMargin;
      blockTokens = s.blockTokens or defaults.blockTokens;
      minContext = s.minContext or defaults.minContext;
      wire = s.wire or defaults.wire;
      listen = if isAttrs (s.listen or { }) then listen else s.listen;
      ollamaApi = s.ollamaApi or defaults.ollamaApi;
      cluster = if isAttrs (s.cluster or { }) then cluster else s.cluster;
      pressure = if isAttrs (s.pressure or { }) then pressure else s.pressure;
      diskCache = diskCacheOf (s.diskCache or null);
      aliases = decl.aliases or { };
      defaultModel = decl.defaultModel or null;
      models = if isAttrs models then mapAttrs (_: e: if isAttrs e then modelOf e else e) models else models;
    };

  # ---- the checks -------------------------------------------------------------------------

  checks = decl:
    let
      p = policyOf decl;
      hostName = if isString p.host then p.host else "(unnamed)";
      who = "host ${hostName}";
      settings = decl.settings or { };

      # A number-valued field: present, a number, in range, and JSON-safe.
      numberChecks = { field, value, ok, range, integer ? false, where ? field }:
        let
          typeOk = if integer then isInt value else isNum value;
        in
        [
          (check typeOk "${who}: ${where} must be ${if integer then "an integer" else "a number"}, got ${if isFloat value then "the float " else ""}${fmt value}")
          (check (!typeOk || ok value) "${who}: ${where} is ${fmt value}, must be ${range}")
          (check (!typeOk || survivesJSON value)
            "${who}: ${where} is ${fmt value} with more precision than this Nix writes to JSON (6 significant digits): round it")
        ];

      budgetChecks =
        let
          m = decl.maxLocalLlmGb or null;
        in
        [
          (check (isAttrs m) "${who}: maxLocalLlmGb must be an attribute set { standalone = GiB; clustered = GiB; }")
          (check (isAttrs m && hasAttr "standalone" m) "${who}: maxLocalLlmGb.standalone is required (GiB for local LLM workers when the host is alone)")
          (check (!(isAttrs m) || unknownKeys modeNames m == [ ])
            "${who}: maxLocalLlmGb has unknown mode(s) ${quoteList (if isAttrs m then unknownKeys modeNames m else [ ])}: the modes are \"standalone\" and \"clustered\"")
        ]
        ++ builtins.concatLists (map
          (mode:
            let
              budget = p.modes.${mode}.maxLocalLlmGb;
              total = p.totalRamGb;
              floor' = p.osFloorGb;
              numbers = isNum budget && isNum total && isNum floor';
              left = total - budget;
            in
            (if isAttrs m && hasAttr "standalone" m then
              numberChecks {
                field = "maxLocalLlmGb.${mode}";
                value = budget;
                ok = v: v >= 1.0 / 1024;  # as the Python side: budgets are whole MiB at least
                range = "at least 1 MiB (0.0009765625 GiB)";
              }
            else [ ])
            ++ [
              (check (!numbers || left >= floor')
                "${who}: ${mode} budget ${fmt budget} GiB leaves ${fmt left} GiB, below the OS floor of ${fmt floor'} GiB: lower maxLocalLlmGb.${mode} or osFloorGb")
            ])
          modeNames)
        ++ (
          let
            s = p.modes.standalone.maxLocalLlmGb;
            c = p.modes.clustered.maxLocalLlmGb;
          in
          [
            (check (!(isNum s && isNum c) || c >= s)
              "${who}: clustered budget ${fmt c} GiB is below the standalone budget of ${fmt s} GiB: raise maxLocalLlmGb.clustered or lower maxLocalLlmGb.standalone")
          ]
        );

      listenChecks =
        let l = p.listen; in
        if !(isAttrs l) then [ (check false "${who}: settings.listen must be an attribute set { host; port; }") ]
        else [
          (check (unknownKeys listenKeys l == [ ]) "${who}: settings.listen has unknown key(s) ${quoteList (unknownKeys listenKeys l)}: allowed are ${quoteList listenKeys}")
          (check (isString l.host) "${who}: settings.listen.host must be a string, got ${fmt l.host}")
        ]
        ++ numberChecks { field = "settings.listen.port"; value = l.port; integer = true; ok = v: v >= 1 && v <= 65535; range = "between 1 and 65535"; };

      peerChecks = i: peer:
        let where = "settings.cluster.peers[${toString i}]"; in
        if !(isAttrs peer) then [ (check false "${who}: ${where} must be an attribute set { host; address; }") ]
        else [
          (check (unknownKeys peerKeys peer == [ ]) "${who}: ${where} has unknown key(s) ${quoteList (unknownKeys peerKeys peer)}: allowed are ${quoteList peerKeys}")
          (check (isName (peer.host or null)) "${who}: ${where}.host is ${fmt (peer.host or null)}, must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
          (check (isString (peer.address or null) && (peer.address or "") != "") "${who}: ${where}.address must be a non-empty string")
        ];

      clusterChecks =
        let c = p.cluster; in
        if !(isAttrs c) then [ (check false "${who}: settings.cluster must be an attribute set { interface; peers; backend; }") ]
        else [
          (check (unknownKeys clusterKeys c == [ ]) "${who}: settings.cluster has unknown key(s) ${quoteList (unknownKeys clusterKeys c)}: allowed are ${quoteList clusterKeys}")
          (check (isString c.interface && c.interface != "") "${who}: settings.cluster.interface must be a non-empty string, got ${fmt c.interface}")
          (check (elem c.backend backends) "${who}: settings.cluster.backend is ${fmt c.backend}, must be one of ${quoteList backends}")
          (check (isList c.peers) "${who}: settings.cluster.peers must be a list of { host; address; }")
        ]
        ++ (if isList c.peers then builtins.concatLists (genList (i: peerChecks i (builtins.elemAt c.peers i)) (length c.peers)) else [ ]);

      pressureChecks =
        let
          t = p.pressure;
          where = f: "settings.pressure.${f}";
          percent = f: numberChecks { field = where f; value = t.${f}; ok = v: v > 0 && v <= 100; range = "above 0 and at most 100 (percent of time stalled)"; };
          warn = t.someAvg10Warn;
          crit = t.someAvg10Critical;
        in
        if !(isAttrs t) then [ (check false "${who}: settings.pressure must be an attribute set { someAvg10Warn; someAvg10Critical; ... }") ]
        else [
          (check (unknownKeys pressureKeys t == [ ]) "${who}: settings.pressure has unknown key(s) ${quoteList (unknownKeys pressureKeys t)}: allowed are ${quoteList pressureKeys}")
          (check (isBool t.enabled) "${who}: settings.pressure.enabled must be true or false, got ${fmt t.enabled}")
          (check (elem t.darwinLevel darwinLevels) "${who}: settings.pressure.darwinLevel is ${fmt t.darwinLevel}, must be one of ${quoteList darwinLevels}")
          (check (!(isNum warn && isNum crit) || warn <= crit)
            "${who}: settings.pressure.someAvg10Warn (${fmt warn}) is above settings.pressure.someAvg10Critical (${fmt crit}): lower the warn line or raise the critical one")
        ]
        ++ percent "someAvg10Warn"
        ++ percent "someAvg10Critical"
        ++ percent "fullAvg10Critical"
        ++ numberChecks { field = where "pageOutsPerS"; value = t.pageOutsPerS; ok = v: v > 0; range = "above 0 pages per second"; }
        ++ numberChecks { field = where "pollS"; value = t.pollS; ok = v: v > 0 && v <= 60; range = "above 0 and at most 60 seconds"; }
        ++ numberChecks { field = where "clearAfterS"; value = t.clearAfterS; ok = v: v >= 0 && v <= 3600; range = "between 0 and 3600 seconds"; };

      modelChecks = name: e:
        let
          where = "model ${name}";
          ints = f: isInt (e.${f} or null);
        in
        if !(isAttrs e) then [ (check false "${who}: ${where} must be an attribute set { path; context; ... }") ]
        else [
          (check (isName name) "${who}: model name \"${name}\" must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
          (check (unknownKeys modelKeys e == [ ]) "${who}: ${where} has unknown key(s) ${quoteList (unknownKeys modelKeys e)}: allowed are ${quoteList modelKeys}")
          (check (hasAttr "path" e && isString e.path && e.path != "") "${who}: ${where}: path must be a non-empty string (the model directory)")
          (check (hasAttr "context" e) "${who}: ${where}: context is required (configured total context, prompt + output, in tokens)")
          (check (elem e.kvDtype kvDtypes) "${who}: ${where}: kvDtype is ${fmt e.kvDtype}, must be one of ${quoteList kvDtypes}")
          (check (isBool e.sharded) "${who}: ${where}: sharded must be true or false, got ${fmt e.sharded}")
          (check (isBool e.mtp) "${who}: ${where}: mtp must be true (the checkpoint's MTP head drafts where it has one) or false, got ${fmt e.mtp}")
          (check (e.draftModel == null || (isString e.draftModel && e.draftModel != "")) "${who}: ${where}: draftModel must be null (off) or a non-empty string (a model directory or ORG/NAME), got ${fmt e.draftModel}")
        ]
        ++ (if hasAttr "context" e then numberChecks { field = "context"; where = "${where}: context"; value = e.context; integer = true; ok = v: v >= 256 && v <= 4194304; range = "between 256 and 4194304 tokens"; } else [ ])
        ++ numberChecks { field = "concurrency"; where = "${where}: concurrency"; value = e.concurrency; integer = true; ok = v: v >= 1 && v <= 1024; range = "between 1 and 1024"; }
        ++ numberChecks { field = "defaultMaxTokens"; where = "${where}: defaultMaxTokens"; value = e.defaultMaxTokens; integer = true; ok = v: v >= 1; range = "at least 1"; }
        ++ numberChecks { field = "maxTokens"; where = "${where}: maxTokens"; value = e.maxTokens; integer = true; ok = v: v >= 1; range = "at least 1"; }
        ++ numberChecks { field = "idleTtlS"; where = "${where}: idleTtlS"; value = e.idleTtlS; integer = false; ok = v: v >= 0; range = "at least 0 seconds (0: never unload)"; }
        ++ numberChecks { field = "promptLookup"; where = "${where}: promptLookup"; value = e.promptLookup; integer = true; ok = v: v >= 0 && v <= 8; range = "between 0 (off) and 8"; }
        ++ numberChecks { field = "numDraftTokens"; where = "${where}: numDraftTokens"; value = e.numDraftTokens; integer = true; ok = v: v >= 1 && v <= 16; range = "between 1 and 16"; }
        ++ [
          (check (!(ints "defaultMaxTokens" && ints "maxTokens") || e.defaultMaxTokens <= e.maxTokens)
            "${who}: ${where}: defaultMaxTokens (${fmt e.defaultMaxTokens}) exceeds maxTokens (${fmt e.maxTokens}): lower defaultMaxTokens")
          (check (!(ints "maxTokens" && ints "context") || e.maxTokens < e.context)
            "${who}: ${where}: maxTokens (${fmt e.maxTokens}) must be below context (${fmt (e.context or null)}) so a prompt fits beside the output reservation: lower maxTokens or raise context")
        ];
    in
    [
      (check (isAttrs decl) "a host declaration must be an attribute set")
      (check (unknownKeys declKeys decl == [ ]) "${who}: unknown declaration key(s) ${quoteList (unknownKeys declKeys decl)}: allowed are ${quoteList declKeys}")
      (check (isName p.host) "host name ${fmt p.host} must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
      (check (isAttrs settings) "${who}: settings must be an attribute set")
      (check (!(isAttrs settings) || unknownKeys settingsKeys settings == [ ])
        "${who}: settings has unknown key(s) ${quoteList (if isAttrs settings then unknownKeys settingsKeys settings else [ ])}: allowed are ${quoteList settingsKeys} (the budgets, floor, reserve and models have their own options)")
      (check (elem p.wire wireChoices) "${who}: settings.wire is ${fmt p.wire}, must be one of ${quoteList wireChoices}")
      (check (isBool p.ollamaApi) "${who}: settings.ollamaApi must be true or false, got ${fmt p.ollamaApi}")
    ]
    ++ numberChecks { field = "totalRamGb"; value = p.totalRamGb; ok = v: v > 0; range = "above 0 GiB"; }
    ++ numberChecks { field = "osFloorGb"; value = p.osFloorGb; ok = v: v >= 0; range = "at least 0 GiB"; }
    ++ budgetChecks
    ++ numberChecks { field = "transientReserve"; value = p.transientReserve; ok = v: v >= 0 && v <= 0.5; range = "between 0 and 0.5 (a fraction of the mode budget)"; }
    ++ numberChecks { field = "settings.tripOffset"; value = p.tripOffset; ok = v: v > 0 && v <= 0.2; range = "above 0 and at most 0.2"; }
    ++ numberChecks { field = "settings.uMargin"; value = p.uMargin; ok = v: v > 0 && v <= 0.2; range = "above 0 and at most 0.2"; }
    ++ numberChecks { field = "settings.blockTokens"; value = p.blockTokens; integer = true; ok = v: v >= 1 && v <= 4096; range = "between 1 and 4096 tokens"; }
    ++ numberChecks { field = "settings.minContext"; value = p.minContext; integer = true; ok = v: v >= 16; range = "at least 16 tokens"; }
    ++ listenChecks
    ++ clusterChecks
    ++ pressureChecks
    ++ (if isAttrs p.models
    then builtins.concatLists (map (n: modelChecks n p.models.${n}) (attrNames p.models))
    else [ (check false "${who}: models must be an attribute set of name = { path; context; ... }") ]);

  errors = decl: map (c: c.message) (filter (c: !c.assertion) (checks decl));

  checkedPolicy = decl:
    let
      errs = errors decl;
      p = policyOf decl;
    in
    if errs == [ ] then p
    else throw ("plimsoll: invalid policy for host ${if isString p.host then p.host else "(unnamed)"}:\n"
      + concatStringsSep "\n" (map (e: "  - ${e}") errs));

  policyJSON = decl: toJSON (checkedPolicy decl);

  # GiB → bytes, as Python's units.gib_to_bytes (floor); exact for whole GiB.
  gibToBytes = gib: floor (gib * 1073741824);
in
{
  inherit schemaVersion defaults modelDefaults policyOf checks errors checkedPolicy
    policyJSON fmt gibToBytes;
  # Handy for hosts: a policy attrset per declaration, keyed like the input.
  checkedPolicies = hosts: mapAttrs (_: checkedPolicy) hosts;
}
