{
  description = "plimsoll: a memory-safe serving stack for MLX language models on unified-memory Macs";

  inputs = {
    nixpkgs.url = "github:NixOS/nixpkgs/nixpkgs-unstable";
    nix-darwin = {
      url = "github:nix-darwin/nix-darwin/master";
      inputs.nixpkgs.follows = "nixpkgs";
    };
  };

  # Inputs are used lazily: `lib`, `darwinModules` and the policy `checks` are builtins
  # only, so they evaluate (and the checks build) without fetching nixpkgs or nix-darwin.
  # Only `packages`, `apps`, `overlays` consumers and `darwinConfigurations` touch them.
  outputs = { self, nixpkgs, nix-darwin }:
    let
      systems = [ "aarch64-darwin" "x86_64-darwin" "x86_64-linux" "aarch64-linux" ];
      forAllSystems = f: builtins.listToAttrs (map (system: { name = system; value = f system; }) systems);

      policy = import ./modules/policy.nix;
      hosts = import ./hosts;

      pkgsFor = system: nixpkgs.legacyPackages.${system};
    in
    {
      # The pure policy functions (builtins only), and the example host declarations.
      #   nix eval --json .#lib.policies.studio
      lib = policy // {
        inherit hosts;
        policies = policy.checkedPolicies hosts;
      };

      overlays.default = final: _prev: {
        plimsoll = final.callPackage ./pkgs { };
      };

      packages = forAllSystems (system: rec {
        plimsoll = (pkgsFor system).callPackage ./pkgs { };
        default = plimsoll;
      });

      # `nix run .#serve`: the proxy on this machine's host policy if it has one
      # (/etc/plimsoll/policy.json, written by the nix-darwin module, with its admin token
      # /var/db/plimsoll/admin-token when readable), else on the
      # embedded default (a policy sized from the live machine, and the demo model).
      apps = forAllSystems (system:
        let
          pkgs = pkgsFor system;
          plimsoll = self.packages.${system}.default;
          serve = pkgs.writeShellApplication {
            name = "plimsoll-serve";
            text = ''
              policy=''${PLIMSOLL_POLICY:-/etc/plimsoll/policy.json}
              # The module's admin token, so the host's link watcher can still reach this proxy.
              token=''${PLIMSOLL_ADMIN_TOKEN_FILE:-/var/db/plimsoll/admin-token}
              if [ -r "$token" ]; then
                set -- --admin-token-file "$token" "$@"
              fi
              if [ -r "$policy" ]; then
                exec ${plimsoll}/bin/plimsoll serve --policy "$policy" "$@"
              fi
              echo "plimsoll: no host policy at $policy; serving on the embedded default" >&2
              exec ${plimsoll}/bin/plimsoll serve "$@"
            '';
          };
        in
        rec {
          serve = { type = "app"; program = "${serve}/bin/plimsoll-serve"; };
          default = serve;
        });

      # The nix-darwin module, with the package defaulting to this flake's build.
      darwinModules.default = { lib, pkgs, ... }: {
        imports = [ ./modules/darwin.nix ];
        services.plimsoll.package =
          lib.mkDefault self.packages.${pkgs.stdenv.hostPlatform.system}.default;
      };
      darwinModules.plimsoll = self.darwinModules.default;

      # The example hosts as full nix-darwin systems:
      #   darwin-rebuild switch --flake .#studio     (on that Mac)
      darwinConfigurations = builtins.mapAttrs
        (name: decl: nix-darwin.lib.darwinSystem {
          modules = [
            self.darwinModules.default
            {
              # cluster.members: the peers' declarations size their ranks (studio ↔ studio-b).
              services.plimsoll = decl // { enable = true; cluster.members = hosts; };
              networking.hostName = decl.host;
              nixpkgs.hostPlatform = "aarch64-darwin";
              # launchd user agents run as the primary user; set your own.
              system.primaryUser = "admin";
              system.stateVersion = 6;
            }
          ];
        })
        hosts;

      # `nix flake check`: every host's policy forced and checked, the pure policy tests,
      # and the broken host rejected (builtins derivations; see tests/checks.nix). The
      # package build (with its pythonImportsCheck and offline Python tests) is added too.
      checks = forAllSystems (system:
        import ./tests/checks.nix { inherit system policy hosts; }
        // { package = self.packages.${system}.default; });
    };
}
