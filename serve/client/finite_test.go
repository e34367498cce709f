package client

import (
	"context"
	"errors"
	"math"
	"path/filepath"
	"testing"

	"github.com/forkvm/forkvm/api"
)

// TestForkNonFinite: a NaN or infinite overcommit is refused as ErrInvalidSpec before
// anything is sent (json cannot encode it: the client used to fail with "json:
// unsupported value: NaN"), and no daemon is needed to say so.
func TestForkNonFinite(t *testing.T) {
	c := New(filepath.Join(t.TempDir(), "none.sock"))
	defer c.Close()
	for _, v := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		if _, err := c.ForkMany(context.Background(), "ck", 2, &api.ManyOptions{Prefix: "p", Overcommit: v}); !errors.Is(err, api.ErrInvalidSpec) {
			t.Errorf("ForkMany(overcommit %v) = %v, want ErrInvalidSpec", v, err)
		}
		if _, err := c.Fork(context.Background(), "ck", &api.ForkOptions{Overcommit: v}); !errors.Is(err, api.ErrInvalidSpec) {
			t.Errorf("Fork(overcommit %v) = %v, want ErrInvalidSpec", v, err)
		}
	}
}
