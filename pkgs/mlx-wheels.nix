# MLX with Metal on aarch64-darwin: the official macOS arm64 wheels (pinned by URL and
# sha256 in ./mlx-wheels.json), installed with nixpkgs' wheel tooling. nixpkgs builds its
# own mlx with Metal off (Apple's `metal` compiler is not in the sandbox), which leaves a
# Mac with no GPU, no enforced memory limit and no wired limit for the watcher to govern.
#
#   mlx-metal  libmlx.dylib, mlx.metallib and libjaccl (the Metal backend)
#   mlx        the Python extension; it loads @rpath/libmlx.dylib from @loader_path/lib,
#              so mlx/lib in its output links to mlx-metal's
#   mlx-lm     pure Python (py3-none-any)
#
# Wheels are installed as shipped: no strip (a stripped Mach-O loses its code signature,
# which Apple Silicon requires), and each one's Requires-Dist (json `requires`) is met by
# `dependencies`, which nixpkgs' runtime-dependency check verifies.
{ lib, python3Packages, fetchurl, platform ? "darwin", pins ? builtins.fromJSON (builtins.readFile ./mlx-wheels.json) }:
let
  py = python3Packages;
  deps = import ./python-deps.nix { };
  pyTag = "cp" + lib.replaceStrings [ "." ] [ "" ] py.python.pythonVersion;

  wheelOf = name: tag:
    let pin = pins.${name}; in
    pin.wheels.${tag} or (throw
      "plimsoll: pkgs/mlx-wheels.json pins no ${name} ${pin.version} wheel for ${tag} (Python ${py.python.pythonVersion}); pinned: ${lib.concatStringsSep ", " (builtins.attrNames pin.wheels)}. Add it (url and sha256 from the package index) or use a Python it pins");

  # A wheel's requirement from nixpkgs, checked against the bound it declares.
  fromNixpkgs = wheel: r:
    let drv = py.${r.attr} or (throw "plimsoll: the ${wheel} wheel needs ${r.text}, which python3Packages lacks"); in
    if deps.satisfies drv.version r.specs then drv
    else throw "plimsoll: the ${wheel} ${pins.${wheel}.version} wheel needs ${r.text}; nixpkgs' python3Packages.${r.attr} is ${drv.version}: update the nixpkgs input (nix flake update nixpkgs) or pin an older ${wheel} in pkgs/mlx-wheels.json";

  # Each Requires-Dist of the wheel (json `requires`): ours where we build it, else nixpkgs'.
  requirements = wheel: ours:
    map (r: ours.${r.name} or (fromNixpkgs wheel r))
      (builtins.filter (deps.appliesOn platform) (map deps.parse pins.${wheel}.requires));

  # The MLX a wheel was released against (its Darwin bound holds for every backend).
  mlxBoundOf = wheel: lib.concatMap (r: lib.optionals (r.name == "mlx") r.specs) (map deps.parse pins.${wheel}.requires);

  wheelPackage = name: tag: ours: extra: py.buildPythonPackage (lib.recursiveUpdate {
    pname = name;
    inherit (pins.${name}) version;
    format = "wheel";
    src = let w = wheelOf name tag; in fetchurl { inherit (w) url sha256; name = w.file; };
    dependencies = requirements name ours;
    dontStrip = true;
    passthru.pin = wheelOf name tag;
    meta = {
      description = "${name} ${pins.${name}.version}, the official wheel";
      homepage = "https://github.com/ml-explore/${if name == "mlx-lm" then "mlx-lm" else "mlx"}";
      platforms = [ "aarch64-darwin" ];
      sourceProvenance = [ lib.sourceTypes.binaryNativeCode ];
      license = lib.licenses.mit;
    };
  } extra);

  mlx-metal = wheelPackage "mlx-metal" "py3" { } { };

  mlx = wheelPackage "mlx" pyTag { inherit mlx-metal; } {
    postInstall = ''
      ln -s ${mlx-metal}/${py.python.sitePackages}/mlx/lib $out/${py.python.sitePackages}/mlx/lib
    '';
    pythonImportsCheck = [ "mlx.core" ];
  };

  # Pure Python (py3-none-any): on top of any mlx.
  mlxLmOn = mlxDrv:
    assert deps.satisfies mlxDrv.version (mlxBoundOf "mlx-lm")
      || throw "plimsoll: the pinned mlx-lm ${pins.mlx-lm.version} wheel needs mlx${lib.concatMapStrings (s: s.op + s.version) (mlxBoundOf "mlx-lm")}; this mlx is ${mlxDrv.version}: update the nixpkgs input or pin an older mlx-lm in pkgs/mlx-wheels.json";
    wheelPackage "mlx-lm" "py3" { mlx = mlxDrv; } {
    meta.platforms = lib.platforms.darwin ++ lib.platforms.linux;
    meta.sourceProvenance = [ lib.sourceTypes.fromSource ];
  };
in
{
  inherit mlx-metal mlx pyTag mlxLmOn;
  mlx-lm = mlxLmOn mlx;
}
