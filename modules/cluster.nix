# Cluster ranks in pure builtins Nix: which `--cluster-rank` figures a host's proxy gets.
#
# A host that declares cluster peers (settings.cluster.peers) and serves a model marked
# `sharded` gets one rank per cluster member, rank 0 first: rank 0 is the host itself, the
# others are its peers in the order declared. Each rank's figures are its member's own
# declaration — CEILING_GIB:TOTAL_RAM_GIB:BUDGET_GIB = clustered budget : totalRamGb :
# clustered budget (while the link is up the watcher holds each member's ceiling at its
# clustered budget) — so a peer must be declared too (`members`, by host name: the same
# plain declarations as hosts/*.nix). Every member agrees on the figures because they
# come from the same declarations.
#
# The ranks' MLX distributed backend (settings.cluster.backend: auto, ring, jaccl, nccl)
# goes on the same command line as `--cluster-backend`, so every member's generated
# command names it; members that declare different backends are an error (one group runs
# on one backend).
#
#   ranksOf decl members   [ { host; totalRamGb; budgetGb; flag; } ], [] when not a member
#   backendOf decl         the declared backend (the policy default when unset)
#   errors decl members    why the ranks cannot be derived (nix-darwin assertion messages)
#   rankArgs decl members  [ "--cluster-backend" "ring" "--cluster-rank" "80:96:80" ... ]
let
  inherit (builtins) concatLists elem filter hasAttr isAttrs isList map;
  policy = import ./policy.nix;

  settingsOf = decl: if isAttrs (decl.settings or null) then decl.settings else { };
  clusterOf = decl: let c = (settingsOf decl).cluster or { }; in if isAttrs c then c else { };
  peersOf = decl:
    let ps = (clusterOf decl).peers or [ ]; in
    if isList ps then map (p: p.host or null) ps else [ ];
  shardedModels = decl:
    let ms = decl.models or { }; in
    if isAttrs ms then filter (n: (ms.${n}.sharded or false) == true) (builtins.attrNames ms) else [ ];

  clusteredGb = d: (d.maxLocalLlmGb or { }).clustered or (d.maxLocalLlmGb or { }).standalone or null;
  rankOf = d:
    let
      budget = clusteredGb d;
      f = policy.fmt;
    in
    {
      host = d.host or null;
      totalRamGb = d.totalRamGb or null;
      budgetGb = budget;
      flag = "${f budget}:${f (d.totalRamGb or null)}:${f budget}";
    };

  backendOf = decl: (clusterOf decl).backend or policy.defaults.cluster.backend;

  isMember = decl: peersOf decl != [ ] && shardedModels decl != [ ];

  errors = decl: members:
    let
      who = "host ${toString (decl.host or "(unnamed)")}";
      missing = filter (h: !(hasAttr h members)) (peersOf decl);
      oneWay = filter (h: hasAttr h members && !(elem (decl.host or null) (peersOf members.${h})))
        (peersOf decl);
      otherBackend = filter (h: backendOf members.${h} != backendOf decl)
        (filter (h: hasAttr h members && !(elem h oneWay)) (peersOf decl));
    in
    if !(isMember decl) then [ ]
    else
      map (h: "${who}: cluster peer ${h} has no declaration: add it to services.plimsoll.cluster.members (its totalRamGb and maxLocalLlmGb.clustered size its rank)") missing
      ++ map (h: "${who}: cluster peer ${h} does not list ${toString decl.host} among its own settings.cluster.peers: declare the link on both hosts") oneWay
      ++ map (h: "${who}: cluster peer ${h} declares settings.cluster.backend ${policy.fmt (backendOf members.${h})}, this host ${policy.fmt (backendOf decl)}: one cluster runs on one backend, declare the same on both hosts") otherBackend;

  ranksOf = decl: members:
    if !(isMember decl) || errors decl members != [ ] then [ ]
    else [ (rankOf decl) ] ++ map (h: rankOf members.${h}) (peersOf decl);
in
{
  inherit errors ranksOf isMember shardedModels peersOf backendOf;
  rankArgs = decl: members:
    let ranks = ranksOf decl members; in
    if ranks == [ ] then [ ]
    else [ "--cluster-backend" (backendOf decl) ]
      ++ concatLists (map (r: [ "--cluster-rank" r.flag ]) ranks);
}
