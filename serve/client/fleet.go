package client

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"

	"github.com/forkvm/forkvm/api"
)

// FleetNodes lists the live nodes of the daemon's fleet (an error with code no_fleet
// when the daemon is in none).
func (c *Client) FleetNodes(ctx context.Context) ([]api.FleetNode, error) {
	var out []api.FleetNode
	err := c.call(ctx, http.MethodGet, "/v1/fleet/nodes", nil, &out)
	return out, err
}

// FleetVMs lists the fleet's forks by their claims.
func (c *Client) FleetVMs(ctx context.Context) ([]api.FleetVM, error) {
	var out []api.FleetVM
	err := c.call(ctx, http.MethodGet, "/v1/fleet/vms", nil, &out)
	return out, err
}

// FleetDeleteVM deletes fleet fork name on whichever node holds it and returns that
// node.
func (c *Client) FleetDeleteVM(ctx context.Context, name string) (api.FleetVMDeleted, error) {
	var out api.FleetVMDeleted
	err := c.call(ctx, http.MethodDelete, "/v1/fleet/vms/"+url.PathEscape(name), nil, &out)
	return out, err
}

// FleetDeleteCheckpoint deletes checkpoint name on the daemon and the copies other
// nodes pulled of it for waves (unpinned, unused), and returns what each node did.
func (c *Client) FleetDeleteCheckpoint(ctx context.Context, name string) ([]api.FleetCheckpointRemoval, error) {
	var out []api.FleetCheckpointRemoval
	err := c.call(ctx, http.MethodDelete, "/v1/fleet/checkpoints/"+url.PathEscape(name), nil, &out)
	return out, err
}

// FleetForkMany runs a wave over the daemon's fleet and streams its lines: one per fork
// as it becomes final (OK, or Error and Code), then a node_lost line for a fork whose
// node died before the wave ended. A line with Index -1 reports a broken stream (its
// Error says why). The channel closes when the daemon ends the stream.
func (c *Client) FleetForkMany(ctx context.Context, req api.FleetForkRequest) (<-chan api.FleetForkEventObject, error) {
	resp, err := c.do(ctx, http.MethodPost, "/v1/fleet/forks", req)
	if err != nil {
		return nil, err
	}
	out := make(chan api.FleetForkEventObject, 16)
	go func() {
		defer close(out)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			var o api.FleetForkEventObject
			if err := json.Unmarshal(sc.Bytes(), &o); err != nil {
				o = api.FleetForkEventObject{ForkEventObject: api.ForkEventObject{Index: -1, Error: fmt.Sprintf("client: fleet fork stream: %v", err)}}
			}
			select {
			case out <- o:
			case <-ctx.Done():
				return
			}
		}
		if err := sc.Err(); err != nil {
			select {
			case out <- api.FleetForkEventObject{ForkEventObject: api.ForkEventObject{Index: -1, Error: fmt.Sprintf("client: fleet fork stream: %v", err)}}:
			case <-ctx.Done():
			}
		}
	}()
	return out, nil
}
