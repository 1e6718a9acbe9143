# pkgs/default.nix (and pkgs/mlx-wheels.nix) evaluated with nixpkgs' lib and a stub nixpkgs
# that does what nixpkgs' Python builders check, offline (nothing is built, nixpkgs itself
# is not needed):
#   - buildPythonApplication / buildPythonPackage run the runtime-dependency check as
#     nixpkgs' pythonRuntimeDepsCheckHook does: every requirement of the package's metadata
#     (pyproject.toml's dependencies minus pythonRemoveDeps; a wheel's Requires-Dist, as
#     pinned in pkgs/mlx-wheels.json) must be among `dependencies`, at a version that
#     satisfies it, or evaluation throws naming it;
#   - python3Packages carries versions (the `nixpkgsVersions` below), so the package's own
#     version checks against pyproject's bounds run too;
#   - fetchurl records its url and sha256.
# Also checked: the check phase imports only what the package gives it.
#
#   nix-instantiate --eval --strict --json tests/pkg-eval.nix --arg nixpkgsLib "$NIXPKGS_LIB" -A report
{ nixpkgsLib }:
let
  lib = import (nixpkgsLib + "/lib");
  deps = import ../pkgs/python-deps.nix { };
  pins = builtins.fromJSON (builtins.readFile ../pkgs/mlx-wheels.json);

  # Versions as a recent nixpkgs has them (at least pyproject's bounds), by attribute.
  nixpkgsVersions = {
    setuptools = "80.9.0"; pydantic = "2.12.4"; click = "8.3.1"; jsonschema = "4.25.1";
    psutil = "7.1.3"; rich = "14.2.0"; tokenizers = "0.22.1"; safetensors = "0.6.2";
    starlette = "0.50.0"; uvicorn = "0.38.0"; httpx = "0.28.1"; prometheus-client = "0.23.1";
    pytestCheckHook = "8.4.2"; hypothesis = "6.142.4"; numpy = "2.3.4"; transformers = "5.7.0";
    sentencepiece = "0.2.1"; protobuf = "6.32.1"; pyyaml = "6.0.3"; jinja2 = "3.1.6";
    mlx = "0.31.1"; mlx-lm = "0.29.1"; httptools = "0.6.4"; llguidance = "1.3.0"; msgpack = "1.1.2";
    huggingface-hub = "1.1.4";
  };

  fakeDrv = attrs: attrs // { type = "derivation"; outPath = "/nix/store/00000000000000000000000000000000-${attrs.pname}-${attrs.version}"; };

  # nixpkgs' runtime-dependency check, on the requirement texts of one package.
  runtimeDepsCheck = who: requirements: dependencies:
    let
      have = builtins.listToAttrs (map (d: { name = deps.normalise d.pname; value = d; }) dependencies);
      problems = lib.concatMap (text:
        let r = deps.parse text; d = have.${r.name} or null; in
        if d == null then [ "${r.text} not installed" ]
        else if !(deps.satisfies d.version r.specs) then [ "${r.text} not satisfied by version ${d.version}" ]
        else [ ]) requirements;
    in
    if problems == [ ] then true
    else throw "pythonRuntimeDepsCheck: ${who}: ${lib.concatStringsSep "; " problems}";

  metadataOf = platform: args:
    if (args.format or null) == "wheel"
    then map (r: r.text) (builtins.filter (deps.appliesOn platform) (map deps.parse pins.${args.pname}.requires))
    else
      let p = builtins.fromTOML (builtins.readFile "${args.src}/pyproject.toml"); in
      builtins.filter (t: !(builtins.elem (deps.parse t).name (args.pythonRemoveDeps or [ ]))) p.project.dependencies;

  build = platform: args:
    assert runtimeDepsCheck "${args.pname}-${args.version}" (metadataOf platform args) (args.dependencies or [ ]);
    fakeDrv (args // { name = "${args.pname}-${args.version}"; meta = args.meta or { }; });

  mkPython = { platform ? "darwin", pythonVersion ? "3.13", versions ? nixpkgsVersions, mlxPlatforms ? [ "aarch64-darwin" ] }:
    lib.mapAttrs (n: v: fakeDrv { pname = n; version = v; meta = { }; }) versions
    // {
      # nixpkgs declares its mlx for these platforms
      mlx = fakeDrv { pname = "mlx"; version = versions.mlx; meta.platforms = mlxPlatforms; };
      python = { inherit pythonVersion; sitePackages = "lib/python${pythonVersion}/site-packages"; };
      buildPythonApplication = build platform;
      buildPythonPackage = build platform;
    };
  fetchurl = { url, sha256, name }: { type = "derivation"; inherit url sha256 name; outPath = "/nix/store/00000000000000000000000000000000-${name}"; };

  pkgFor = system: py: import ../pkgs {
    inherit lib fetchurl;
    python3Packages = py;
    stdenv.hostPlatform = lib.systems.elaborate system;
  };
  darwin = pkgFor "aarch64-darwin" (mkPython { });
  darwin312 = pkgFor "aarch64-darwin" (mkPython { pythonVersion = "3.12"; });
  darwin310 = pkgFor "aarch64-darwin" (mkPython { pythonVersion = "3.10"; });
  linux = pkgFor "x86_64-linux" (mkPython { platform = "linux"; });
  linuxMlx = pkgFor "x86_64-linux" (mkPython { platform = "linux"; mlxPlatforms = lib.platforms.linux ++ [ "aarch64-darwin" ]; versions = nixpkgsVersions // { mlx = "0.32.4"; }; });
  linuxOldMlx = pkgFor "x86_64-linux" (mkPython { platform = "linux"; mlxPlatforms = lib.platforms.linux; });
  linuxNewMlxLm = pkgFor "x86_64-linux" (mkPython { platform = "linux"; mlxPlatforms = lib.platforms.linux; versions = nixpkgsVersions // { mlx-lm = "0.31.0"; }; });
  oldStarlette = pkgFor "aarch64-darwin" (mkPython { versions = nixpkgsVersions // { starlette = "0.36.3"; }; });
  noPrometheus = pkgFor "aarch64-darwin" (mkPython { versions = removeAttrs nixpkgsVersions [ "prometheus-client" ]; });
  oldTransformers = pkgFor "aarch64-darwin" (mkPython { versions = nixpkgsVersions // { transformers = "4.57.1"; }; });

  names = p: map (d: d.pname) p.dependencies;
  depNamed = p: n: lib.findFirst (d: d.pname == n) null p.dependencies;
  forced = x: (builtins.tryEval (builtins.deepSeq x true)).success;
  srcUrl = d: d.src.url;

  # The check phase's imports (conftest and the enabled files), against what it is given.
  testFiles = [ "tests/conftest.py" "tests/pure_tier.py" ] ++ darwin.enabledTestPaths;
  importsOf = f: lib.unique (lib.concatMap (l:
    let
      a = builtins.match "import ([A-Za-z0-9_]+).*" l;
      b = builtins.match "from ([A-Za-z0-9_]+)[. ].*" l;
    in (if a != null then a else [ ]) ++ (if b != null then b else [ ]))
    (lib.splitString "\n" (builtins.readFile (../python + "/${f}"))));
  # Python's standard library, as far as tests are likely to reach (an import outside it
  # and outside the inputs fails this test: give the check phase that package, or drop it).
  stdlib = [ "__future__" "abc" "argparse" "asyncio" "base64" "collections" "contextlib" "copy"
    "dataclasses" "datetime" "enum" "errno" "fractions" "functools" "glob" "hashlib" "importlib"
    "inspect" "io" "itertools" "json" "logging" "math" "multiprocessing" "operator" "os" "pathlib" "platform"
    "queue" "random" "re" "select" "shlex" "shutil" "signal" "socket" "stat" "string" "struct"
    "subprocess" "sys" "tempfile" "textwrap" "threading" "time" "types" "typing" "unittest"
    "urllib" "uuid" "warnings" "zipfile" ];
  # import name → distribution (PEP 503) for what the test files may use
  distOf = { pytest = "pytestcheckhook"; _pytest = "pytestcheckhook"; hypothesis = "hypothesis"; httpx = "httpx"; jsonschema = "jsonschema"; click = "click"; pydantic = "pydantic"; };
  given = map (d: deps.normalise d.pname) (darwin.dependencies ++ darwin.nativeCheckInputs);
  unmet = lib.concatMap (f: map (m: "${f}: ${m}") (builtins.filter (m:
    !(builtins.elem m stdlib) && m != "plimsoll"
    && !(distOf ? ${m} && builtins.elem distOf.${m} given)) (importsOf f))) testFiles;

  eq = name: actual: expected: {
    inherit name;
    ok = actual == expected;
    detail = "got ${builtins.toJSON actual}, expected ${builtins.toJSON expected}";
  };
  cases = [
    (eq "version from pyproject.toml" darwin.version (builtins.fromTOML (builtins.readFile ../python/pyproject.toml)).project.version)
    (eq "aarch64-darwin: the runtime-dependency check passes (every pyproject requirement is an input)" (forced darwin.dependencies) true)
    (eq "aarch64-darwin: the inputs are exactly pyproject's requirements, in its order"
      (map deps.normalise (names darwin)) (map (r: r.name) deps.runtime))
    (eq "aarch64-darwin: mlx-lm is the pinned wheel, on the pinned Metal mlx, on mlx-metal"
      [ (srcUrl (depNamed darwin "mlx-lm")) (srcUrl darwin.passthru.mlx) (srcUrl (builtins.head darwin.passthru.mlx.dependencies)) ]
      [ pins.mlx-lm.wheels.py3.url pins.mlx.wheels.cp313.url pins.mlx-metal.wheels.py3.url ])
    (eq "aarch64-darwin: the fetched wheels carry the pinned sha256"
      (map (d: d.src.sha256) [ darwin.passthru.mlx-lm darwin.passthru.mlx ]) [ pins.mlx-lm.wheels.py3.sha256 pins.mlx.wheels.cp313.sha256 ])
    (eq "aarch64-darwin: wheels installed unstripped (code signatures kept); mlx/lib links mlx-metal's"
      [ darwin.passthru.mlx.dontStrip darwin.passthru.mlx.format
        (lib.hasInfix "-mlx-metal-0.32.4/lib/python3.13/site-packages/mlx/lib $out/lib/python3.13/site-packages/mlx/lib" darwin.passthru.mlx.postInstall) ]
      [ true "wheel" true ])
    (eq "aarch64-darwin, Python 3.12: the cp312 wheel" (srcUrl darwin312.passthru.mlx) pins.mlx.wheels.cp312.url)
    (eq "aarch64-darwin, Python 3.10 (no wheel pinned): evaluation fails" (forced darwin310.dependencies) false)
    (eq "aarch64-darwin: nothing removed from the metadata" darwin.pythonRemoveDeps [ ])
    (eq "x86_64-linux without nixpkgs' mlx: the pure core, mlx-lm dropped from metadata and inputs"
      [ (forced linux.dependencies) (builtins.elem "mlx-lm" (names linux)) (builtins.elem "mlx" (names linux)) linux.pythonRemoveDeps ]
      [ true false false [ "mlx-lm" ] ])
    (eq "x86_64-linux with nixpkgs' mlx 0.32.4 (CPU): mlx from nixpkgs; its mlx-lm 0.29 is below pyproject's 0.30, so the pinned wheel"
      [ (forced linuxMlx.dependencies) (depNamed linuxMlx "mlx").version (srcUrl (depNamed linuxMlx "mlx-lm")) ]
      [ true "0.32.4" pins.mlx-lm.wheels.py3.url ])
    (eq "x86_64-linux with nixpkgs' mlx 0.31 and mlx-lm 0.29: the wheel would need mlx 0.32.2, so evaluation fails"
      (forced linuxOldMlx.dependencies) false)
    (eq "x86_64-linux with nixpkgs' mlx and a new enough mlx-lm: both from nixpkgs"
      (map (d: d.version) [ (depNamed linuxNewMlxLm "mlx") (depNamed linuxNewMlxLm "mlx-lm") ]) [ "0.31.1" "0.31.0" ])
    (eq "nixpkgs' starlette below pyproject's bound: evaluation fails" (forced oldStarlette.dependencies) false)
    (eq "a requirement nixpkgs lacks (prometheus-client): evaluation fails" (forced noPrometheus.dependencies) false)
    (eq "nixpkgs' transformers below the mlx-lm wheel's bound: evaluation fails" (forced oldTransformers.passthru.mlx-lm) false)
    (eq "the stub's runtime-dependency check fails a stale list (httpx left out)"
      (forced (build "darwin" (darwin // { dependencies = builtins.filter (d: d.pname != "httpx") darwin.dependencies; }))) false)
    (eq "the check phase imports only what it is given (stdlib, plimsoll, inputs, nativeCheckInputs)" unmet [ ])
    (eq "the check-phase test files exist" (builtins.all (f: builtins.pathExists (../python + "/${f}")) testFiles) true)
    (eq "pythonImportsCheck covers the package, the CLI and --check"
      (map (m: builtins.elem m darwin.pythonImportsCheck) [ "plimsoll" "plimsoll.cli" "plimsoll.cli.check" ]) [ true true true ])
    (eq "the source holds pyproject.toml and the package"
      (map (p: builtins.pathExists "${darwin.src}/${p}") [ "pyproject.toml" "plimsoll/__init__.py" "plimsoll/core/policy.schema.json" ])
      [ true true true ])
    (eq "the meta names the CLI" darwin.meta.mainProgram "plimsoll")
  ];
  results = map (c: { inherit (c) name ok; detail = if c.ok then "" else c.detail; }) cases;
  passed = builtins.length (builtins.filter (r: r.ok) results);
  failed = builtins.length (builtins.filter (r: !r.ok) results);
  report = lib.concatStringsSep "\n"
    (map (r: if r.ok then "ok   ${r.name}" else "FAIL ${r.name}: ${r.detail}") results
      ++ [ "${toString passed} passed, ${toString failed} failed" ]) + "\n";
in
{
  inherit passed failed report results;
  # for tests/nix/run.sh: the messages a user sees (tryEval cannot read them)
  inherit oldStarlette noPrometheus oldTransformers darwin310 linuxOldMlx;
}
