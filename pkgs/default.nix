# The plimsoll package: the Python application in ../python, built with nixpkgs'
# buildPythonApplication. Call it with `pkgs.callPackage ./pkgs { }` (the flake does).
#
# Dependencies are python/pyproject.toml's, generated at evaluation (./python-deps.nix):
# each requirement is taken from python3Packages and its version checked against
# pyproject's bound, so nixpkgs' runtime-dependency check holds and a pyproject change
# cannot be forgotten here. MLX, per platform:
#   aarch64-darwin  Metal MLX: the official macOS arm64 wheels of mlx, mlx-metal and mlx-lm,
#                   pinned in ./mlx-wheels.json (./mlx-wheels.nix). nixpkgs' own mlx is
#                   built with Metal off (CPU only), so it is not used.
#   elsewhere       nixpkgs' mlx where nixpkgs has it for the platform (the CPU backend:
#                   pyproject's `mlx[cpu]` extra), with nixpkgs' mlx-lm, or the pinned
#                   mlx-lm wheel where nixpkgs' is older than pyproject's bound; where
#                   nixpkgs has no mlx, the package gives the policy, admission and CLI
#                   tools (`plimsoll policy check`, `plimsoll admit`, `--check`) and
#                   mlx-lm is dropped from its metadata.
{
  lib,
  stdenv,
  python3Packages,
  fetchurl,
}:

let
  py = python3Packages;
  deps = import ./python-deps.nix { };
  inherit (deps) version;

  metalWheels = stdenv.hostPlatform.isDarwin && stdenv.hostPlatform.isAarch64;
  wheels = import ./mlx-wheels.nix {
    inherit lib python3Packages fetchurl;
    platform = if stdenv.hostPlatform.isDarwin then "darwin" else "linux";
  };
  nixpkgsMlx = lib.meta.availableOn stdenv.hostPlatform (py.mlx or { meta.platforms = [ ]; });

  # pyproject's `mlx[cpu]>=…` bound (the extra Linux installs use).
  mlxBound = (lib.findFirst (r: r.name == "mlx") { specs = [ ]; } deps.cpu).specs;
  newEnough = drv: r: drv ? version && deps.satisfies drv.version r.specs;

  # requirement name → derivation, for the names nixpkgs alone does not settle.
  mlxSet =
    if metalWheels then { inherit (wheels) mlx mlx-lm; }
    else if nixpkgsMlx then {
      mlx = if deps.satisfies py.mlx.version mlxBound then py.mlx
        else throw "plimsoll: nixpkgs' python3Packages.mlx is ${py.mlx.version}; python/pyproject.toml's cpu extra needs mlx${lib.concatMapStrings (s: s.op + s.version) mlxBound}: update the nixpkgs input";
      # nixpkgs' mlx-lm if it meets pyproject's bound, else the pinned (pure Python) wheel
      mlx-lm =
        let r = lib.findFirst (r: r.name == "mlx-lm") null deps.runtime; in
        if py ? mlx-lm && newEnough py.mlx-lm r then py.mlx-lm else wheels.mlxLmOn py.mlx;
    }
    else { };
  withMlx = mlxSet != { };
  # Without MLX the engine edge is absent: these leave the metadata (and the inputs).
  removed = lib.optionals (!withMlx) [ "mlx-lm" ];

  fromNixpkgs = r:
    let drv = py.${r.attr} or (throw "plimsoll: python/pyproject.toml needs ${r.text}, but python3Packages has no ${r.attr}: add a name to pkgs/python-deps.nix's table or update the nixpkgs input"); in
    if newEnough drv r then drv
    else throw "plimsoll: python/pyproject.toml needs ${r.text}; nixpkgs' python3Packages.${r.attr} is ${drv.version or "unversioned"}: update the nixpkgs input (nix flake update nixpkgs)";

  resolve = r: mlxSet.${r.name} or (fromNixpkgs r);

  runtime = builtins.filter (r: !(builtins.elem r.name removed)) deps.runtime;

  # The check phase: the pure core (no engine, no servers, no network; it runs the same
  # on every platform). Its tools come from pyproject's `test` extra.
  checkTools = [ "pytest" "hypothesis" ];
  checkInputs = map fromNixpkgs (builtins.filter (r: builtins.elem r.name checkTools) deps.test);

  # ../python without build litter (a plain filter: evaluates on any Nix, and the store
  # path changes only when the sources do).
  root = toString ../python;
  src = builtins.path {
    name = "plimsoll-source";
    path = ../python;
    filter = path: _type:
      let
        rel = lib.removePrefix "${root}/" (toString path);
        base = baseNameOf path;
      in
      !(base == "__pycache__" || base == ".pytest_cache" || base == ".ruff_cache"
        || lib.hasSuffix ".pyc" base || lib.hasSuffix ".egg-info" base
        || rel == "build" || rel == "dist" || rel == ".venv");
  };
in
py.buildPythonApplication {
  pname = "plimsoll";
  inherit version src;
  pyproject = true;

  build-system = [ (fromNixpkgs (deps.parse "setuptools>=68")) ];

  dependencies = map resolve runtime ++ lib.optional (withMlx && !metalWheels) mlxSet.mlx;

  pythonRemoveDeps = removed;

  pythonImportsCheck = [
    "plimsoll"
    "plimsoll.core.policy"
    "plimsoll.core.admission"
    "plimsoll.cli"
    "plimsoll.cli.check"
  ];

  nativeCheckInputs = checkInputs;
  preCheck = ''
    export HOME=$(mktemp -d)
  '';
  enabledTestPaths = [ "tests/core/test_policy.py" "tests/core/test_admission.py" ];

  passthru = {
    inherit withMlx metalWheels;
    mlx = mlxSet.mlx or null;
    mlx-lm = mlxSet.mlx-lm or null;
  };

  meta = {
    description = "Memory-safe serving stack for MLX language models on unified-memory Macs";
    license = lib.licenses.mit;
    mainProgram = "plimsoll";
    platforms = lib.platforms.darwin ++ lib.platforms.linux;
  };
}
