"""What the benchmark scripts in bench/ share; each script is one kind of measurement.

Owns:

- :mod:`.servers`: a server under test (plimsoll or ``mlx_lm.server``) started from a command
  template on a free 127.0.0.1 port in its own process group, waited for, stopped and checked
  gone;
- :mod:`.samplers`: readings taken while something runs: RSS and CPU of a process tree, GPU
  memory (NVML, ``nvidia-smi``), MLX memory in process, copy bandwidth, py-spy profiles;
- :mod:`.status`: plimsoll's ``GET /v1/plimsoll/status`` read defensively (fields by key path);
- :mod:`.workloads`: the requests (standard-library source cut with the model's tokenizer, so
  every server gets the same bytes) and the streaming client that times every token;
- :mod:`.phases`: the serving phases run against one started server (agentic session,
  decode, concurrent streams, stall, sub-agents);
- :mod:`.serving_figures`: the serving comparison's figures, ratios and targets;
- :mod:`.cluster_runs`: bench/cluster.py's runs of a built model on one rank and on two
  (start, measure streams and each rank's memory, close; a refusal or failure as the figure);
- :mod:`.engine`: the in-process engine driver of the benchmarks (decode loops, mlx-lm's own
  generators as anchors), on :mod:`plimsoll.engine.drive`;
- :mod:`.step_split`: where the engine thread's time per decode step goes in process
  (graph building, waiting for tokens, the scheduler's Python; bench/overhead.py);
- :mod:`.kv_layouts`: bench/engine.py's two layout figures (sliding-window bytes held,
  quantized read paths);
- :mod:`.report`: host facts, output names (``<measurement>-<machine>-<date>``), JSON and the
  one markdown table writer.

Scripts run as ``python bench/NAME.py`` (bench/ is then first on ``sys.path``) and import
``from lib import …``; the package imports plimsoll, never a script.
"""
