package engine

import (
	"os/exec"
	"strings"
	"testing"
)

// TestEmbedderLinksNoImageBuilder: a program that embeds the engine (this package, and
// examples/embed, which uses only it) links neither image building (package guest,
// go-containerregistry and what it pulls in: docker's CLI config, credential helpers,
// logrus) nor the daemon (serve; api's wire types are the engine's own), so an embedder's build and go.sum stay small. A new import of
// one of them anywhere below the engine fails here.
func TestEmbedderLinksNoImageBuilder(t *testing.T) {
	// "go" is the go command running this test: go test puts its GOROOT/bin first on
	// the test binary's PATH.
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("no go command to list dependencies with: %v", err)
	}
	forbidden := []string{
		"github.com/forkvm/forkvm/guest", "github.com/forkvm/forkvm/serve", "github.com/forkvm/forkvm/serve/client",
		"github.com/forkvm/forkvm/serve/local", "github.com/google/go-containerregistry", "github.com/docker",
		"github.com/sirupsen/logrus",
	}
	for _, pkg := range []string{".", "../examples/embed"} {
		out, err := exec.Command(goBin, "list", "-deps", pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", pkg, err, out)
		}
		deps := strings.Fields(string(out))
		if len(deps) < 10 || !strings.Contains(string(out), "github.com/forkvm/forkvm/internal/guestboot") {
			t.Fatalf("go list -deps %s listed only %v", pkg, deps)
		}
		for _, d := range deps {
			for _, f := range forbidden {
				if d == f || strings.HasPrefix(d, f+"/") && f != "github.com/forkvm/forkvm/serve" {
					t.Errorf("%s links %s", pkg, d)
				}
			}
		}
	}
}
