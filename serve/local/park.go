package local

import (
	"context"

	"github.com/forkvm/forkvm/api"
)

func (l *Local) Park(ctx context.Context, name string) (api.ParkResult, error) {
	e, err := l.engine()
	if err != nil {
		return api.ParkResult{}, err
	}
	r, err := e.Park(ctx, name)
	if err != nil {
		return api.ParkResult{}, err
	}
	return *r, nil
}

func (l *Local) Wake(ctx context.Context, name string) (api.WakeResult, error) {
	e, err := l.engine()
	if err != nil {
		return api.WakeResult{}, err
	}
	r, err := e.Wake(ctx, name, nil)
	if err != nil {
		return api.WakeResult{}, err
	}
	return *r, nil
}

func (l *Local) SetNoPark(_ context.Context, name string, noPark bool) error {
	e, err := l.engine()
	if err != nil {
		return err
	}
	return e.SetNoPark(name, noPark)
}
