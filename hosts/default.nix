# The example hosts, by name. Plain data (no functions, no nixpkgs): the flake turns
# each into a darwinConfiguration, the tests into policy JSON.
{
  studio = import ./studio.nix;
  macbook = import ./macbook.nix;
}
