# `checks.<system>` for both flakes (the top-level one and tests/flake.nix), built from
# builtins only: no nixpkgs, so they evaluate and build offline. Each check is a
# derivation whose environment holds the forced policy JSON of one host, so evaluating
# the check (what `nix flake check` does first) forces that host's checked policy, and a
# host that breaks a rule fails evaluation with its named message. The builder is
# /bin/sh, present on macOS and (as the sandbox shell) on Linux.
{ system, policy ? import ../modules/policy.nix, hosts ? import ../hosts }:
let
  inherit (builtins) attrNames derivation listToAttrs map toJSON tryEval;

  hostCheck = name: decl: derivation {
    inherit system;
    name = "plimsoll-policy-${name}";
    builder = "/bin/sh";
    # Forced when the derivation is instantiated: a bad host throws right here.
    policyJson = policy.policyJSON decl;
    args = [ "-c" ''printf '%s\n' "$policyJson" > "$out"'' ];
  };

  evalTests = import ./policy-eval.nix;

  brokenHost = import ./hosts/broken-mini.nix;
in
listToAttrs (map (name: { name = "policy-${name}"; value = hostCheck name hosts.${name}; }) (attrNames hosts))
// {
  # The pure-policy test suite: its report becomes the output, and any failure fails evaluation.
  policy-eval = derivation {
    inherit system;
    name = "plimsoll-policy-eval";
    builder = "/bin/sh";
    report =
      if evalTests.failed == 0 then evalTests.report
      else throw "plimsoll policy tests failed:\n${evalTests.report}";
    args = [ "-c" ''printf '%s' "$report" > "$out"'' ];
  };

  # The assert fires: the deliberately broken host must not produce a policy.
  policy-broken-host-rejected = derivation {
    inherit system;
    name = "plimsoll-policy-broken-host-rejected";
    builder = "/bin/sh";
    verdict =
      if (tryEval (policy.policyJSON brokenHost)).success
      then throw "tests/hosts/broken-mini.nix produced a policy: the OS-floor check did not fire"
      else "rejected: ${toJSON (policy.errors brokenHost)}";
    args = [ "-c" ''printf '%s\n' "$verdict" > "$out"'' ];
  };
}
