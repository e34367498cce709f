package local

import (
	"context"

	"github.com/forkvm/forkvm/api"
)

// Protect records the VM's protection and takes its first point at once: the loop runs
// while this API's engine is open, and in a daemon started later (it resumes what the
// manifests record).
func (l *Local) Protect(ctx context.Context, name string, opts *api.ProtectOptions) (api.ProtectionInfo, error) {
	e, err := l.engine()
	if err != nil {
		return api.ProtectionInfo{}, err
	}
	if _, err := e.Protect(ctx, name, opts); err != nil {
		return api.ProtectionInfo{}, err
	}
	p, err := e.ProtectNow(ctx, name)
	if p == nil {
		return api.ProtectionInfo{}, err
	}
	return *p, err
}

func (l *Local) Unprotect(ctx context.Context, name string) error {
	e, err := l.engine()
	if err != nil {
		return err
	}
	return e.Unprotect(ctx, name)
}
