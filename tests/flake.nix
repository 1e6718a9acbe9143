{
  # The offline policy checks as a flake with no inputs: `nix flake check ./tests`
  # (from a git checkout: flakes see only tracked files) needs no network and no nixpkgs.
  # Each check forces one host's checked policy (see checks.nix), so a host that breaks
  # a rule fails the check at evaluation with its named message.
  description = "plimsoll: offline policy checks (no inputs)";

  outputs = { self }:
    let
      systems = [ "aarch64-darwin" "x86_64-darwin" "x86_64-linux" "aarch64-linux" ];
      forAllSystems = f: builtins.listToAttrs (map (system: { name = system; value = f system; }) systems);
      policy = import ../modules/policy.nix;
      hosts = import ../hosts;
    in
    {
      checks = forAllSystems (system: import ./checks.nix { inherit system policy hosts; });
      # The policies themselves: `nix eval --json ./tests#lib.policies`.
      lib.policies = policy.checkedPolicies hosts;
    };
}
