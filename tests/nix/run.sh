#!/usr/bin/env bash
# The Nix tests, offline (Debian's nix-bin, Nix ≥ 2.8; no nixpkgs, no network):
#
#   1. pure policy    nix-instantiate over tests/policy-eval.nix (example hosts → expected
#                     JSON; every broken declaration throws with its named message), plus
#                     the thrown text itself checked on stderr.
#   2. flake checks   `nix flake check` on tests/flake.nix (no inputs) in a scratch git
#                     copy; then the broken host is added to the hosts and the check must
#                     fail naming it. The top-level flake's offline outputs (lib, the
#                     policy checks) are evaluated and built too: its inputs stay unfetched.
#   3. Python agrees  python/tests/nix/test_nix_policy.py, when a Python with plimsoll and
#                     pytest is found ($PYTHON, else python3); otherwise SKIP (say so).
#   0. inputs         (online) the nix-darwin and nixpkgs trees flake.lock pins, fetched when
#                     NIX_DARWIN_SRC / NIXPKGS_LIB are not given and the network allows.
#   4. nix-darwin     (optional) tests/darwin-eval.nix in real nix-darwin with nixpkgs'
#                     lib and a stub pkgs, and tests/pkg-eval.nix, when NIX_DARWIN_SRC and
#                     NIXPKGS_LIB name local snapshots; then every launchd job the module
#                     generates is run through the real CLI with --check
#                     (python/tests/nix/test_darwin_commands.py); otherwise SKIP.
#
#   5. pinned nixpkgs (online) the real package and the example darwinConfigurations
#                     instantiated with the pinned nixpkgs (nothing is built).
#
# Usage: tests/nix/run.sh            (from anywhere; exit status 0 only if nothing failed)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"

# Single-user, offline Nix: what a CI container with Debian's nix-bin needs.
export NIX_CONFIG="${NIX_CONFIG:-}"$'\nexperimental-features = nix-command flakes\nsubstituters =\nbuild-users-group =\nsandbox = false\nwarn-dirty = false'

if ! command -v nix-instantiate >/dev/null 2>&1; then
  echo "tests/nix/run.sh: nix-instantiate not found (install Nix: apt-get install -y nix-bin)" >&2
  exit 1
fi

failures=0
section() { printf '\n== %s\n' "$1"; }
pass() { printf 'ok   %s\n' "$1"; }
fail() { printf 'FAIL %s\n' "$1"; failures=$((failures + 1)); }

scratch=$(mktemp -d "${TMPDIR:-/tmp}/plimsoll-nix.XXXXXX")
trap 'rm -rf "$scratch"' EXIT

system=$(nix-instantiate --eval --expr builtins.currentSystem | tr -d '"')
echo "$(nix --version); system $system"

# ---- 0. the pinned nix-darwin and nixpkgs, when reachable --------------------------------
# Sections 4 and 5 need nix-darwin and nixpkgs. NIX_DARWIN_SRC / NIXPKGS_LIB name local
# snapshots; without them, the revisions flake.lock pins are fetched when the network
# allows (the same trees the flake's users get), else those sections SKIP and say why.
online=0
if [ "${PLIMSOLL_NIX_OFFLINE:-}" != 1 ] && command -v curl >/dev/null 2>&1 &&
   curl -sfI --max-time 10 https://github.com >/dev/null 2>&1; then
  online=1
fi
locked_tree() { # flake.lock node → store path of its locked source tree (fetched once)
  nix eval --impure --raw --expr "let n = (builtins.fromJSON (builtins.readFile $REPO/flake.lock)).nodes.$1.locked; in
    builtins.fetchTarball { url = \"https://github.com/\${n.owner}/\${n.repo}/archive/\${n.rev}.tar.gz\"; sha256 = n.narHash; }"
}
if [ "$online" = 1 ] && { [ -z "${NIX_DARWIN_SRC:-}" ] || [ -z "${NIXPKGS_LIB:-}" ]; }; then
  section "0. fetching the nix-darwin and nixpkgs that flake.lock pins"
  if NIX_DARWIN_SRC=$(locked_tree nix-darwin) && PINNED_NIXPKGS=$(locked_tree nixpkgs); then
    NIXPKGS_LIB=$PINNED_NIXPKGS
    echo "nix-darwin $NIX_DARWIN_SRC; nixpkgs $PINNED_NIXPKGS"
  else
    fail "fetching the pinned nix-darwin / nixpkgs"; NIX_DARWIN_SRC=; NIXPKGS_LIB=
  fi
fi

# ---- 1. the pure policy ---------------------------------------------------------------------
section "1. pure policy (tests/policy-eval.nix)"
nix eval --raw --file tests/policy-eval.nix report
failed=$(nix-instantiate --eval --strict --json tests/policy-eval.nix -A failed)
[ "$failed" = 0 ] || failures=$((failures + failed))

# builtins.tryEval cannot see a thrown message: check it on stderr, as a user would see it.
expect_throw() { # name expression expected-text
  local out
  if out=$(nix-instantiate --eval --strict --json --expr "$2" 2>&1); then
    fail "$1: evaluated, expected a throw"
  elif grep -qF -- "$3" <<<"$out"; then
    pass "$1"
  else
    fail "$1: the error does not say: $3"; printf '%s\n' "$out" | sed 's/^/     /'
  fi
}
expect_throw "broken host: reading its policy JSON throws the named message" \
  '(import ./modules/policy.nix).policyJSON (import ./tests/hosts/broken-mini.nix)' \
  "host mini: standalone budget 60 GiB leaves 4 GiB, below the OS floor of 8 GiB"
expect_throw "clustered below standalone throws the named message" \
  '(import ./modules/policy.nix).policyJSON ((import ./hosts).studio // { maxLocalLlmGb = { standalone = 72; clustered = 64; }; })' \
  "host studio: clustered budget 64 GiB is below the standalone budget of 72 GiB"
for host in studio studio-b macbook; do
  if nix-instantiate --eval --strict --json \
       --expr "(import ./modules/policy.nix).checkedPolicy (import ./hosts).$host" >"$scratch/$host.json" &&
     nix-instantiate --eval --strict --json --expr \
       "builtins.fromJSON (builtins.readFile $scratch/$host.json) == builtins.fromJSON (builtins.readFile ./tests/expected/$host.json)" |
       grep -qx true; then
    pass "hosts/$host.nix → tests/expected/$host.json (nix-instantiate --eval --strict --json)"
  else
    fail "hosts/$host.nix does not yield tests/expected/$host.json"
  fi
done

# ---- 2. the flakes --------------------------------------------------------------------------
section "2. nix flake check (tests/flake.nix, no inputs)"
# Flakes see only what git tracks: work on a scratch copy, whatever the checkout's state.
copy_repo() { # dest
  mkdir -p "$1/python"
  cp -R flake.nix flake.lock modules hosts pkgs tests "$1/"
  cp python/pyproject.toml "$1/python/"
  git -C "$1" init -q
  git -C "$1" add -A
}
copy_repo "$scratch/ok"
if out=$(nix flake check "$scratch/ok/tests" 2>&1); then
  pass "nix flake check ./tests builds every host's policy check"
else
  fail "nix flake check ./tests"; printf '%s\n' "$out" | sed 's/^/     /'
fi
if nix build --no-link "$scratch/ok/tests#checks.$system.policy-studio" >/dev/null 2>&1 &&
   nix eval --raw "$scratch/ok/tests#checks.$system.policy-studio.policyJson" >"$scratch/studio-check.json" 2>/dev/null &&
   nix-instantiate --eval --expr "builtins.fromJSON (builtins.readFile $scratch/studio-check.json)
       == builtins.fromJSON (builtins.readFile $REPO/tests/expected/studio.json)" | grep -qx true; then
  pass "the studio check carries the studio policy JSON"
else
  fail "the studio check does not carry the expected policy JSON"
fi

# The meta-test: a check that never forced a host would let a bad host pass. Add the
# broken host to the hosts of a second copy: the flake check must fail, naming it.
copy_repo "$scratch/bad"
mv "$scratch/bad/hosts/default.nix" "$scratch/bad/hosts/examples.nix"
echo '(import ./examples.nix) // { mini = import ../tests/hosts/broken-mini.nix; }' >"$scratch/bad/hosts/default.nix"
git -C "$scratch/bad" add -A
msg="host mini: standalone budget 60 GiB leaves 4 GiB, below the OS floor of 8 GiB"
if out=$(nix flake check "$scratch/bad/tests" 2>&1); then
  fail "nix flake check passed with the broken host among the hosts"
elif grep -qF "$msg" <<<"$out"; then
  pass "with the broken host added, nix flake check fails: $msg"
else
  fail "nix flake check failed without naming the broken host"; printf '%s\n' "$out" | sed 's/^/     /'
fi
if out=$(nix build --no-link "$scratch/bad/tests#checks.$system.policy-mini" 2>&1); then
  fail "the broken host's own check built"
elif grep -qF "$msg" <<<"$out"; then
  pass "the broken host's own check (policy-mini) fails evaluation with the named message"
else
  fail "policy-mini failed without the named message"; printf '%s\n' "$out" | sed 's/^/     /'
fi

section "2b. top-level flake, offline outputs (inputs must stay unfetched)"
if out=$(nix eval --json "$scratch/ok#lib.policies" 2>&1) && grep -q '"studio"' <<<"$out"; then
  pass "nix eval .#lib.policies (no nixpkgs, no nix-darwin fetched)"
else
  fail "nix eval .#lib.policies"; printf '%s\n' "$out" | sed 's/^/     /'
fi
if out=$(nix build --no-link "$scratch/ok#checks.$system.policy-studio" "$scratch/ok#checks.$system.policy-macbook" \
           "$scratch/ok#checks.$system.policy-eval" "$scratch/ok#checks.$system.policy-broken-host-rejected" 2>&1); then
  pass "nix build .#checks.$system.policy-{studio,macbook,eval,broken-host-rejected}"
else
  fail "the top-level policy checks"; printf '%s\n' "$out" | sed 's/^/     /'
fi
echo "(not here: packages, apps, darwinConfigurations and \`nix flake check\` on the top-level flake need nixpkgs)"

# ---- 3. Python agrees -----------------------------------------------------------------------
section "3. Python agrees (python/tests/nix/test_nix_policy.py)"
py=${PYTHON:-python3}
if "$py" -c 'import plimsoll, pytest, jsonschema' >/dev/null 2>&1; then
  if "$py" -m pytest python/tests/nix/test_nix_policy.py -q -p no:cacheprovider; then
    pass "python/tests/nix/test_nix_policy.py"
  else
    fail "python/tests/nix/test_nix_policy.py"
  fi
else
  echo "SKIP: no Python with plimsoll + pytest at '$py' (set PYTHON=/path/to/venv/bin/python)"
fi

# ---- 4. nix-darwin (optional) ---------------------------------------------------------------
section "4. the module in real nix-darwin (optional)"
if [ -n "${NIX_DARWIN_SRC:-}" ] && [ -n "${NIXPKGS_LIB:-}" ] &&
   [ -f "$NIX_DARWIN_SRC/eval-config.nix" ] && [ -f "$NIXPKGS_LIB/lib/default.nix" ]; then
  args=(--arg nixDarwinSrc "$NIX_DARWIN_SRC" --arg nixpkgsLib "$NIXPKGS_LIB")
  nix eval --raw --file tests/darwin-eval.nix "${args[@]}" report
  failed=$(nix-instantiate --eval --strict --json tests/darwin-eval.nix "${args[@]}" -A failed)
  [ "$failed" = 0 ] || failures=$((failures + failed))
  section "4b. pkgs/default.nix with nixpkgs' lib and a stub nixpkgs (runtime-deps check, versions, wheels)"
  nix eval --raw --file tests/pkg-eval.nix --arg nixpkgsLib "$NIXPKGS_LIB" report
  failed=$(nix-instantiate --eval --strict --json tests/pkg-eval.nix --arg nixpkgsLib "$NIXPKGS_LIB" -A failed)
  [ "$failed" = 0 ] || failures=$((failures + failed))
  # The messages a user meets (tryEval cannot see them): each names what to change.
  expect_pkg_throw() { # attr expected-text
    local out
    if out=$(nix-instantiate --eval --strict --json tests/pkg-eval.nix --arg nixpkgsLib "$NIXPKGS_LIB" -A "$1" 2>&1); then
      fail "pkg-eval $1: evaluated, expected a throw"
    elif grep -qF -- "$2" <<<"$out"; then
      pass "pkg-eval $1: $2"
    else
      fail "pkg-eval $1: the error does not say: $2"; printf '%s\n' "$out" | sed 's/^/     /'
    fi
  }
  expect_pkg_throw oldStarlette.dependencies "python/pyproject.toml needs starlette>=0.37; nixpkgs' python3Packages.starlette is 0.36.3: update the nixpkgs input"
  expect_pkg_throw noPrometheus.dependencies "python/pyproject.toml needs prometheus-client>=0.20, but python3Packages has no prometheus-client"
  expect_pkg_throw oldTransformers.passthru.mlx-lm "the mlx-lm 0.32.2 wheel needs transformers>=5.7.0; nixpkgs' python3Packages.transformers is 4.57.1"
  expect_pkg_throw darwin310.passthru.mlx.src.url "pkgs/mlx-wheels.json pins no mlx 0.32.4 wheel for cp310"
  expect_pkg_throw linuxOldMlx.dependencies "the pinned mlx-lm 0.32.2 wheel needs mlx>=0.32.2; this mlx is 0.31.1"
  section "4c. every generated launchd job through the real CLI with --check (python/tests/nix/test_darwin_commands.py)"
  if "$py" -c 'import plimsoll, pytest' >/dev/null 2>&1; then
    if NIX_DARWIN_SRC="$NIX_DARWIN_SRC" NIXPKGS_LIB="$NIXPKGS_LIB" \
         "$py" -m pytest python/tests/nix/test_darwin_commands.py -q -p no:cacheprovider; then
      pass "python/tests/nix/test_darwin_commands.py"
    else
      fail "python/tests/nix/test_darwin_commands.py"
    fi
  else
    echo "SKIP: no Python with plimsoll + pytest at '$py'"
  fi
else
  echo "SKIP: set NIX_DARWIN_SRC (a nix-darwin checkout) and NIXPKGS_LIB (a nixpkgs or nixpkgs.lib checkout)"
fi

# ---- 5. the real package with the pinned nixpkgs (online) -----------------------------------
section "5. the package and the example systems with the pinned nixpkgs (needs the network)"
if [ "$online" = 1 ]; then
  # A copy of what git tracks, as a flake sees it (the package needs all of python/).
  mkdir -p "$scratch/full"
  git ls-files -z | (cd "$REPO" && xargs -0 cp --parents -t "$scratch/full")
  git -C "$scratch/full" init -q && git -C "$scratch/full" add -A
  for sys in aarch64-darwin x86_64-linux; do
    # Instantiating the derivation runs nixpkgs' own evaluation of every input, and the
    # package's version checks against pyproject's bounds on the pinned python3Packages.
    if out=$(nix eval --raw "$scratch/full#packages.$sys.default.drvPath" 2>&1); then
      pass "packages.$sys.default instantiates with the pinned nixpkgs ($out)"
    else
      fail "packages.$sys.default with the pinned nixpkgs"; printf '%s\n' "$out" | sed 's/^/     /'
    fi
  done
  if out=$(nix eval --json "$scratch/full#packages.aarch64-darwin.default.passthru" \
             --apply 'p: { mlx = p.mlx.src.url; mlxLm = p.mlx-lm.src.url; metal = p.metalWheels; }' 2>&1) &&
     grep -q '"metal":true' <<<"$out" && grep -q 'macosx_14_0_arm64' <<<"$out"; then
    pass "aarch64-darwin: Metal MLX from the pinned wheels ($out)"
  else
    fail "aarch64-darwin: the MLX wheels"; printf '%s\n' "$out" | sed 's/^/     /'
  fi
  for host in studio studio-b macbook; do
    if out=$(nix eval --raw "$scratch/full#darwinConfigurations.$host.system.drvPath" 2>&1); then
      pass "darwinConfigurations.$host instantiates (the whole nix-darwin system)"
    else
      fail "darwinConfigurations.$host"; printf '%s\n' "$out" | tail -20 | sed 's/^/     /'
    fi
  done
else
  echo "SKIP: offline (no route to the flake inputs); set PLIMSOLL_NIX_OFFLINE=1 to skip on purpose"
fi

section "summary"
if [ "$failures" -eq 0 ]; then
  echo "all Nix tests passed"
else
  echo "$failures failure(s)"
  exit 1
fi
