# The plimsoll package: the Python application in ../python, built with nixpkgs'
# buildPythonApplication. Call it with `pkgs.callPackage ./pkgs { }` (the flake does).
#
# MLX: mlx and mlx-lm come from nixpkgs where nixpkgs has them (aarch64-darwin only).
# Note that nixpkgs builds mlx with MLX_BUILD_METAL=false (Apple's `metal` compiler is
# not in the sandbox), i.e. CPU-only: for GPU serving, pass a Metal-enabled build, e.g.
#   plimsoll.override { python3Packages = python3Packages.overrideScope (_: _: { mlx = myMetalMlx; }); }
# Elsewhere the package still gives the policy, admission and CLI tools (`plimsoll policy
# check`, `plimsoll admit`); the mlx-lm requirement is dropped from its metadata there.
{
  lib,
  stdenv,
  python3Packages,
}:

let
  # The version is pyproject.toml's (its one `version = "..."` line).
  pyprojectLines = builtins.filter builtins.isString (builtins.split "\n" (builtins.readFile ../python/pyproject.toml));
  versionMatches = builtins.filter (m: m != null) (map (builtins.match ''version = "([^"]+)"'') pyprojectLines);
  version = builtins.head (builtins.head versionMatches);

  withMlx = lib.meta.availableOn stdenv.hostPlatform python3Packages.mlx;

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
python3Packages.buildPythonApplication {
  pname = "plimsoll";
  inherit version src;
  pyproject = true;

  build-system = [ python3Packages.setuptools ];

  dependencies =
    with python3Packages;
    [
      pydantic
      click
      jsonschema
      psutil
      rich
      tokenizers
      safetensors
    ]
    ++ lib.optionals withMlx [
      mlx
      mlx-lm
    ];

  # Without MLX (every platform but aarch64-darwin in nixpkgs) the engine edge is absent:
  # drop the requirement from the metadata so the runtime-deps check holds.
  pythonRemoveDeps = lib.optionals (!withMlx) [ "mlx-lm" ];

  pythonImportsCheck = [
    "plimsoll"
    "plimsoll.core.policy"
    "plimsoll.core.admission"
    "plimsoll.cli"
  ];

  # The Python tests run here. With MLX (aarch64-darwin) the whole suite but the Nix
  # agreement test (it needs nix-instantiate, which the build sandbox lacks); without
  # MLX only the pure core, which imports no engine: the policy and the admission
  # arithmetic.
  nativeCheckInputs = with python3Packages; [
    pytestCheckHook
    hypothesis
  ];
  preCheck = ''
    export HOME=$(mktemp -d)
  '';
  enabledTestPaths =
    if withMlx then [ "tests" ] else [ "tests/test_policy.py" "tests/test_admission.py" ];
  disabledTestPaths = [ "tests/test_nix_policy.py" ];

  passthru = { inherit withMlx; };

  meta = {
    description = "Memory-safe serving stack for MLX language models on unified-memory Macs";
    license = lib.licenses.mit;
    mainProgram = "plimsoll";
    platforms = lib.platforms.darwin ++ lib.platforms.linux;
  };
}
