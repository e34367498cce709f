package engine

import (
	"context"
	"errors"
	"testing"
)

// TestCreateUnknownImageBeforeAdmission: a create naming no image fails with
// ErrImageNotFound even when the budget would refuse it (a budget of 0 vCPUs here), so
// bad input is reported as such whatever else runs on the host.
func TestCreateUnknownImageBeforeAdmission(t *testing.T) {
	cfg := testConfig(t)
	cfg.Overcommit = 0.01 // 0 vCPUs on any host up to 99 CPUs
	e := newTestEngine(t, cfg)
	_, err := e.Create(context.Background(), Spec{Name: "x", Image: "nope"})
	if !errors.Is(err, ErrImageNotFound) {
		t.Errorf("create with an unknown image and a full budget: %v, want ErrImageNotFound", err)
	}
	_, err = e.Create(context.Background(), Spec{Name: "y"})
	if !errors.Is(err, ErrAdmission) {
		t.Errorf("create with a full budget: %v, want ErrAdmission", err)
	}
}
