# python/pyproject.toml's requirements as nixpkgs sees them, in pure builtins Nix: the
# package's dependency list is generated from them, so it cannot drift from pyproject.
#
#   parse "starlette>=0.37"  → { name = "starlette"; attr = "starlette"; extras = [ ];
#                                specs = [ { op = ">="; version = "0.37"; } ]; text = ...; }
#   satisfies "0.38.1" specs → true when every specifier holds (PEP 440 release numbers)
#   runtime / test / cpu     → pyproject's [project] dependencies, the `test` and `cpu` extras
#
# Markers: only `platform_system == "..."` / `sys_platform == "..."` are read (appliesOn);
# any other marker is refused, so a new one is a decision, not a silent mistake.
{ pyproject ? builtins.fromTOML (builtins.readFile ../python/pyproject.toml) }:
let
  inherit (builtins) all compareVersions filter head length map match replaceStrings split
    isString elemAt;

  # PEP 503 name → python3Packages attribute, only where the two differ.
  attrNames = {
    pytest = "pytestCheckHook"; # the check phase's pytest is nixpkgs' hook
  };

  lower = replaceStrings
    [ "A" "B" "C" "D" "E" "F" "G" "H" "I" "J" "K" "L" "M" "N" "O" "P" "Q" "R" "S" "T" "U" "V" "W" "X" "Y" "Z" "_" "." ]
    [ "a" "b" "c" "d" "e" "f" "g" "h" "i" "j" "k" "l" "m" "n" "o" "p" "q" "r" "s" "t" "u" "v" "w" "x" "y" "z" "-" "-" ];
  normalise = name: lower name;

  strip = s: let m = match "[ ]*(.*[^ ])[ ]*" s; in if m == null then "" else head m;
  splitOn = sep: s: filter isString (split sep s);

  parseSpec = text: req:
    let m = match "(===|==|!=|~=|>=|<=|>|<)[ ]*([0-9][0-9A-Za-z.*+!-]*)" (strip text); in
    if m == null then throw "python/pyproject.toml: cannot read the version specifier '${text}' of '${req}'"
    else { op = elemAt m 0; version = elemAt m 1; };

  # The one marker form wheels here use: `platform_system == "Darwin"` (or sys_platform).
  parseMarker = text: req:
    let m = match ";[ ]*(platform_system|sys_platform)[ ]*==[ ]*[\"']([A-Za-z0-9]+)[\"'][ ]*" text; in
    if m == null then throw "'${req}': pkgs/python-deps.nix reads only platform_system/sys_platform == \"...\" markers"
    else { key = elemAt m 0; value = lower (elemAt m 1); };

  parse = req:
    let
      m = match "[ ]*([A-Za-z0-9][A-Za-z0-9._-]*)[ ]*([[]([A-Za-z0-9, _-]*)[]])?[ ]*([^;]*)(;.*)?" req;
      name = normalise (elemAt m 0);
      specText = strip (elemAt m 3);
    in
    if m == null then throw "python/pyproject.toml: cannot read the requirement '${req}'"
    else {
      marker = if elemAt m 4 == null then null else parseMarker (elemAt m 4) req;
      inherit name;
      attr = attrNames.${name} or name;
      extras = if elemAt m 2 == null then [ ] else map strip (splitOn "," (elemAt m 2));
      specs = if specText == "" then [ ] else map (s: parseSpec s req) (splitOn "," specText);
      text = strip req;
    };

  # PEP 440 release comparison is enough for pyproject's bounds (no pre-releases there).
  holds = version: spec:
    let
      inherit (spec) op;
      bound = spec.version;
      c = compareVersions version bound;
    in
    if op == ">=" then c >= 0
    else if op == ">" then c > 0
    else if op == "<=" then c <= 0
    else if op == "<" then c < 0
    else if op == "==" || op == "===" then c == 0
    else if op == "!=" then c != 0
    else if op == "~=" then c >= 0 && compareVersions version (compatUpper bound) < 0
    else false;
  # ~= 1.4 means >= 1.4, < 2; ~= 1.4.2 means >= 1.4.2, < 1.5.
  compatUpper = bound:
    let
      parts = splitOn "\\." bound;
      keep = builtins.genList (i: elemAt parts i) (length parts - 1);
      bumped = toString ((builtins.fromJSON (elemAt keep (length keep - 1))) + 1);
    in
    builtins.concatStringsSep "." (builtins.genList (i: elemAt keep i) (length keep - 1) ++ [ bumped ]);

  project = pyproject.project;
  extra = name: map parse (project.optional-dependencies.${name} or [ ]);
in
{
  inherit parse normalise;
  satisfies = version: specs: all (holds version) specs;
  # Does requirement r apply on a platform ("darwin" or "linux")?
  appliesOn = platform: r: r.marker == null || r.marker.value == platform;
  runtime = map parse project.dependencies;
  test = extra "test";
  cpu = extra "cpu";
  version = project.version;
}
