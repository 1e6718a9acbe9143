# A 36 GB MacBook Pro (M3/M4 Pro class): standalone only, and a tighter floor —
# a laptop keeps a browser, an editor and a video call beside the model, so more of
# its RAM is reserved for the OS (10 of 36 GiB, against 16 of 96 on the Studio).
# No clustered budget is declared: it defaults to the standalone one.
{
  host = "macbook";
  totalRamGb = 36;
  osFloorGb = 10;
  maxLocalLlmGb.standalone = 24;
  transientReserve = 0.08;
  models = {
    "llama-3.1-8b" = {
      path = "/Users/Shared/models/Meta-Llama-3.1-8B-Instruct-4bit";
      context = 16384;
      concurrency = 1;
      defaultMaxTokens = 1024;
      maxTokens = 4096;
    };
  };
  settings = {
    wire = "weights";
    minContext = 4096;
  };
}
