# Deliberately broken: a 64 GiB Mac mini whose standalone budget eats into the OS floor
# (64 − 60 = 4 GiB left, the floor is 8). Every policy entry point must refuse it with
#   host mini: standalone budget 60 GiB leaves 4 GiB, below the OS floor of 8 GiB
# Kept under tests/, never in hosts/: the test flake's meta-test adds it to the hosts to
# prove that `nix flake check` fails on it.
{
  host = "mini";
  totalRamGb = 64;
  osFloorGb = 8;
  maxLocalLlmGb.standalone = 60;
  models = {
    "qwen3-0.6b" = { path = "/Users/Shared/models/Qwen3-0.6B-bf16"; context = 8192; maxTokens = 1024; };
  };
}
