# A 96 GB Mac Studio (M2/M3 Ultra class) that also joins a Thunderbolt cluster.
# Plain data: the same shape as the services.plimsoll.* options of the nix-darwin
# module (see modules/darwin.nix), and what modules/policy.nix turns into policy.json.
# Every *Gb is GiB (Apple's "96 GB" of unified memory is 96 GiB).
{
  host = "studio";
  totalRamGb = 96;
  # Always left to macOS, WindowServer and everything that is not an LLM worker.
  osFloorGb = 16;
  maxLocalLlmGb = {
    # Alone: 72 GiB for workers (the DESIGN.md example: u < 72/96 − 0.05 = 0.70).
    standalone = 72;
    # Clustered: a larger share, the rest of a sharded model lives on the peer.
    # 96 − 80 = 16 GiB: exactly the OS floor, still allowed.
    clustered = 80;
  };
  # High-water transient allocations, as a fraction of the mode budget.
  transientReserve = 0.05;
  models = {
    # The large MoE: 80B total, 3B active, 12 of 48 layers hold a KV cache.
    "qwen3-next-80b-a3b" = {
      path = "/Users/Shared/models/Qwen3-Next-80B-A3B-Instruct-4bit";
      context = 65536;
      concurrency = 2;
      defaultMaxTokens = 2048;
      maxTokens = 8192;
      kvDtype = "bfloat16";
      sharded = true;
    };
    # The small model for quick completions.
    "qwen3-0.6b" = {
      path = "/Users/Shared/models/Qwen3-0.6B-bf16";
      context = 32768;
      concurrency = 4;
      defaultMaxTokens = 512;
      maxTokens = 4096;
    };
  };
  settings = {
    wire = "footprint";
    listen = { host = "127.0.0.1"; port = 8080; };
    cluster = {
      interface = "bridge0";
      backend = "ring";
      peers = [ { host = "studio-b"; address = "10.77.0.2"; } ];
    };
  };
}
