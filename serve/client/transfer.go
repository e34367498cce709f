package client

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/forkvm/forkvm/api"
)

// ExportCheckpoint describes checkpoint name for a pull: its relocatable manifest and
// its files with digests and data extents (GET /v1/checkpoints/{name}/export).
func (c *Client) ExportCheckpoint(ctx context.Context, name string) (*api.CheckpointExport, error) {
	var out api.CheckpointExport
	if err := c.call(ctx, http.MethodGet, "/v1/checkpoints/"+url.PathEscape(name)+"/export", nil, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// ReadCheckpointFile returns n bytes at off of the file of checkpoint name that its
// export calls file (an HTTP Range request; the holder must answer with exactly that
// range). Close the reader.
func (c *Client) ReadCheckpointFile(ctx context.Context, name, file string, off, n int64) (io.ReadCloser, error) {
	if off < 0 || n <= 0 {
		return nil, fmt.Errorf("%w: range %d+%d", api.ErrInvalidSpec, off, n)
	}
	u := c.base + "/v1/checkpoints/" + url.PathEscape(name) + "/export/file?name=" + url.QueryEscape(file)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Range", "bytes="+strconv.FormatInt(off, 10)+"-"+strconv.FormatInt(off+n-1, 10))
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode/100 != 2 {
		defer resp.Body.Close()
		return nil, decodeError(resp)
	}
	want := fmt.Sprintf("bytes %d-%d/", off, off+n-1)
	if cr := resp.Header.Get("Content-Range"); resp.StatusCode != http.StatusPartialContent || !strings.HasPrefix(cr, want) || resp.ContentLength != n {
		resp.Body.Close()
		return nil, fmt.Errorf("%w: %s of %s: asked bytes %d+%d, got HTTP %d %q (%d bytes)", api.ErrProtocol, file, name, off, n, resp.StatusCode, cr, resp.ContentLength)
	}
	return resp.Body, nil
}

// PullCheckpoint asks the daemon to pull checkpoint name from the daemon at from (its
// TCP API, "http://host:port"), authenticated with token (POST /v1/checkpoints/pull);
// from may instead name a node of the daemon's fleet (token is then not used).
// The daemon fetches its files' data extents, checks each file's digest (a mismatch is
// api.ErrDigest and leaves nothing) and commits it; pulling a checkpoint it has already
// fetches nothing (Present).
func (c *Client) PullCheckpoint(ctx context.Context, name, from, token string) (*api.PullResult, error) {
	return c.PullCheckpointWith(ctx, api.PullRequest{Checkpoint: name, From: from, Token: token})
}

// PullCheckpointWith is PullCheckpoint with every field of req (its progress deadline,
// which the daemon applies to every read from the holder).
func (c *Client) PullCheckpointWith(ctx context.Context, req api.PullRequest) (*api.PullResult, error) {
	if _, err := req.ProgressTimeout(); err != nil {
		return nil, err
	}
	var out api.PullResult
	if err := c.call(ctx, http.MethodPost, "/v1/checkpoints/pull", req, &out); err != nil {
		return nil, err
	}
	return &out, nil
}
