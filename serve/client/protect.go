package client

import (
	"context"
	"net/http"

	"github.com/forkvm/forkvm/api"
)

// Protect protects the VM name (POST /v1/vms/NAME/protect); opts may be nil.
func (c *Client) Protect(ctx context.Context, name string, opts *api.ProtectOptions) (api.ProtectionInfo, error) {
	var o api.ProtectOptions
	if opts != nil {
		o = *opts
	}
	var r api.ProtectionInfo
	err := c.call(ctx, http.MethodPost, vmPath(name)+"/protect", o, &r)
	return r, err
}

// Unprotect ends the VM name's protection (DELETE /v1/vms/NAME/protect).
func (c *Client) Unprotect(ctx context.Context, name string) error {
	return c.call(ctx, http.MethodDelete, vmPath(name)+"/protect", nil, nil)
}
