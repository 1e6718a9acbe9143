# The example hosts, by name. Plain data (no functions, no nixpkgs): the flake turns
# each into a darwinConfiguration, the tests into policy JSON. studio and studio-b are
# the two members of one Thunderbolt cluster (each lists the other as a peer).
{
  studio = import ./studio.nix;
  studio-b = import ./studio-b.nix;
  macbook = import ./macbook.nix;
}
