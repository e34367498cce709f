package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/fleet"
)

// TestFleetFlagsRefused: serve's fleet flags in combinations that cannot work are
// refused with fleet.ErrConfig before anything starts (no engine, no NATS).
func TestFleetFlagsRefused(t *testing.T) {
	dir := t.TempDir()
	file := func(name string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(name+"\n"), mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	pw, cert, key, ca := file("pw", 0o600), file("cert.pem", 0o644), file("key.pem", 0o600), file("ca.pem", 0o644)
	openKey := file("open.key", 0o644)
	embedded := []string{"--cluster-listen", "127.0.0.1:0", "--cluster-user", "u", "--cluster-password-file", pw}
	external := []string{"--cluster", "nats://127.0.0.1:4222", "--cluster-user", "u", "--cluster-password-file", pw}
	with := func(base []string, more ...string) []string { return append(append([]string{}, base...), more...) }
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"TLS without a fleet", []string{"--cluster-tls-cert", cert, "--cluster-tls-key", key}, "needs --cluster"},
		{"client listener without a fleet", []string{"--cluster-client-listen", "127.0.0.1:0"}, "needs --cluster"},
		{"certificate without its key", with(embedded, "--cluster-tls-cert", cert), "go together"},
		{"key without its certificate", with(external, "--cluster-tls-key", key), "go together"},
		{"a key others may read", with(embedded, "--cluster-tls-cert", cert, "--cluster-tls-key", openKey), "readable by others"},
		{"a missing certificate", with(embedded, "--cluster-tls-cert", filepath.Join(dir, "none"), "--cluster-tls-key", key), "no such file"},
		{"a missing CA", with(external, "--cluster-tls-ca", filepath.Join(dir, "none")), "no such file"},
		{"embedded server with a CA and no certificate", with(embedded, "--cluster-tls-ca", ca), "own --cluster-tls-cert"},
		{"client listener of an external cluster", with(external, "--cluster-client-listen", "127.0.0.1:0"), "embedded server"},
		{"negative max jobs", with(embedded, "--max-jobs", "-1"), "--max-jobs -1"},
		{"max jobs without a fleet", []string{"--max-jobs", "2"}, "needs --cluster"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := &cli.Command{Name: "serve", Flags: append([]cli.Flag{&cli.StringFlag{Name: "listen"}}, fleetServeFlags()...),
				Action: func(ctx context.Context, cmd *cli.Command) error {
					_, err := planFleet(cmd)
					return err
				}}
			err := cmd.Run(context.Background(), append([]string{"serve"}, tc.args...))
			if !errors.Is(err, fleet.ErrConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%v: %v, want fleet.ErrConfig saying %q", tc.args, err, tc.want)
			}
		})
	}
}
