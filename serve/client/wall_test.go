package client

import (
	"os/exec"
	"strings"
	"testing"
)

// TestRemoteLinksNoEngine: a program that talks to a daemon (this package, and
// examples/remote, which uses it and api only) links neither the engine, the
// guest image builder, the memory-file layer nor the agent protocol, so it builds for a
// host without any of them. A new import of one of them anywhere below these packages
// fails here.
func TestRemoteLinksNoEngine(t *testing.T) {
	// "go" is the go command running this test: go test puts its GOROOT/bin first on
	// the test binary's PATH.
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("no go command to list dependencies with: %v", err)
	}
	forbidden := []string{"engine", "guest", "memfile", "vsockd"}
	for _, pkg := range []string{".", "../../api", "../../examples/remote"} {
		out, err := exec.Command(goBin, "list", "-deps", pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", pkg, err, out)
		}
		deps := strings.Fields(string(out))
		if len(deps) < 10 {
			t.Fatalf("go list -deps %s listed only %v", pkg, deps)
		}
		for _, d := range deps {
			rest, ok := strings.CutPrefix(d, "github.com/forkvm/forkvm/")
			if !ok {
				continue
			}
			for _, f := range forbidden {
				if rest == f || strings.HasPrefix(rest, f+"/") {
					t.Errorf("%s links %s", pkg, d)
				}
			}
		}
	}
}
