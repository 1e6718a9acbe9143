# Optional: pkgs/default.nix evaluated with nixpkgs' lib and a stub python3Packages whose
# buildPythonApplication returns its arguments (nothing is built; nixpkgs itself is not
# needed). Checks the platform split (mlx + mlx-lm only where nixpkgs has mlx), the
# version read from pyproject.toml, and that the source holds the package.
#
#   nix-instantiate --eval --strict --json tests/pkg-eval.nix --arg nixpkgsLib "$NIXPKGS_LIB" -A report
{ nixpkgsLib }:
let
  lib = import (nixpkgsLib + "/lib");

  stubDrv = name: extra: { type = "derivation"; inherit name; pname = name; outPath = "/nix/store/00000000000000000000000000000000-${name}"; meta = { }; } // extra;
  names = [ "setuptools" "pydantic" "click" "jsonschema" "psutil" "rich" "tokenizers" "safetensors" "pytestCheckHook" "hypothesis" "mlx-lm" ];
  python3Packages = lib.genAttrs names (n: stubDrv n { })
    // {
    # As nixpkgs declares it: aarch64-darwin only.
    mlx = stubDrv "mlx" { meta.platforms = [ "aarch64-darwin" ]; };
    buildPythonApplication = args: args;
  };

  build = system: import ../pkgs {
    inherit lib python3Packages;
    stdenv.hostPlatform = lib.systems.elaborate system;
  };
  darwin = build "aarch64-darwin";
  linux = build "x86_64-linux";
  depNames = p: map (d: d.name) p.dependencies;

  eq = name: actual: expected: {
    inherit name;
    ok = actual == expected;
    detail = "got ${builtins.toJSON actual}, expected ${builtins.toJSON expected}";
  };
  cases = [
    (eq "version from pyproject.toml" darwin.version
      (builtins.head (builtins.head (builtins.filter (m: m != null)
        (map (builtins.match ''version = "([^"]+)"'') (lib.splitString "\n" (builtins.readFile ../python/pyproject.toml)))))))
    (eq "aarch64-darwin: mlx and mlx-lm from nixpkgs" (lib.subtractLists (depNames linux) (depNames darwin)) [ "mlx" "mlx-lm" ])
    (eq "aarch64-darwin: nothing removed from the metadata" darwin.pythonRemoveDeps [ ])
    (eq "x86_64-linux: no mlx, and mlx-lm dropped from the metadata" [ (builtins.elem "mlx" (depNames linux)) linux.pythonRemoveDeps ] [ false [ "mlx-lm" ] ])
    (eq "pythonImportsCheck covers the package and the CLI" (builtins.elem "plimsoll.cli" darwin.pythonImportsCheck) true)
    (eq "the source holds pyproject.toml and the package"
      (map (p: builtins.pathExists "${darwin.src}/${p}") [ "pyproject.toml" "plimsoll/__init__.py" "plimsoll/core/policy.schema.json" ])
      [ true true true ])
    (eq "the meta names the CLI" darwin.meta.mainProgram "plimsoll")
    (eq "checkPhase: the whole suite with MLX, the pure core without; never the Nix test"
      [ darwin.enabledTestPaths linux.enabledTestPaths darwin.disabledTestPaths ]
      [ [ "tests" ] [ "tests/test_policy.py" "tests/test_admission.py" ] [ "tests/test_nix_policy.py" ] ])
    (eq "the pure-core test files exist" (map (f: builtins.pathExists (../python + "/${f}")) linux.enabledTestPaths) [ true true ])
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
}
