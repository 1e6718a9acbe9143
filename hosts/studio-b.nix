# The second Mac Studio of the Thunderbolt cluster (64 GB, M2 Max class): studio's peer.
# It declares the link back (peers = [ studio ]) and the same sharded model, so either
# host's proxy can serve it across both; each member's rank is sized from its own
# declaration (modules/cluster.nix).
{
  host = "studio-b";
  totalRamGb = 64;
  osFloorGb = 12;
  maxLocalLlmGb = {
    standalone = 48;
    clustered = 52;
  };
  transientReserve = 0.05;
  models = {
    "qwen3-next-80b-a3b" = {
      path = "/Users/Shared/models/Qwen3-Next-80B-A3B-Instruct-4bit";
      context = 65536;
      concurrency = 2;
      defaultMaxTokens = 2048;
      maxTokens = 8192;
      kvDtype = "bfloat16";
      sharded = true;
    };
  };
  settings = {
    wire = "footprint";
    cluster = {
      interface = "bridge0";
      backend = "ring";
      peers = [ { host = "studio"; address = "10.77.0.1"; } ];
    };
  };
}
