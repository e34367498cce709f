package client

import (
	"context"
	"net/http"

	"github.com/forkvm/forkvm/api"
)

// Park parks the VM name (POST /v1/vms/NAME/park).
func (c *Client) Park(ctx context.Context, name string) (api.ParkResult, error) {
	var r api.ParkResult
	err := c.call(ctx, http.MethodPost, vmPath(name)+"/park", nil, &r)
	return r, err
}

// Wake wakes the parked VM name (POST /v1/vms/NAME/wake).
func (c *Client) Wake(ctx context.Context, name string) (api.WakeResult, error) {
	var r api.WakeResult
	err := c.call(ctx, http.MethodPost, vmPath(name)+"/wake", nil, &r)
	return r, err
}

// SetNoPark opts the VM name out of (or back into) the daemon's idle parking
// (PATCH /v1/vms/NAME).
func (c *Client) SetNoPark(ctx context.Context, name string, noPark bool) error {
	return c.call(ctx, http.MethodPatch, vmPath(name), api.VMPatch{NoPark: &noPark}, nil)
}
