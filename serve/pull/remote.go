package pull

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/forkvm/forkvm/api"
)

// Remote is the Source of the daemon whose TCP API is at baseURL ("http://host:port"),
// authenticated with token.
func Remote(baseURL, token string) Source {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	return &remote{base: strings.TrimRight(baseURL, "/"), token: token, hc: &http.Client{Transport: tr}}
}

type remote struct {
	base, token string
	hc          *http.Client
}

func (r *remote) get(ctx context.Context, path, rng string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, r.base+path, nil)
	if err != nil {
		return nil, err
	}
	if rng != "" {
		req.Header.Set("Range", rng)
	}
	if r.token != "" {
		req.Header.Set("Authorization", "Bearer "+r.token)
	}
	resp, err := r.hc.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode/100 == 2 {
		return resp, nil
	}
	defer resp.Body.Close()
	var er api.ErrorResponse
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if json.Unmarshal(b, &er) == nil && er.Error.Code != "" {
		if s := api.SentinelOf(er.Error.Code); s != nil {
			return nil, fmt.Errorf("%w: holder: %s", s, er.Error.Message)
		}
		return nil, fmt.Errorf("pull: holder: HTTP %d %s: %s", resp.StatusCode, er.Error.Code, er.Error.Message)
	}
	return nil, fmt.Errorf("pull: holder: HTTP %d: %s", resp.StatusCode, strings.TrimSpace(string(b)))
}

// ExportCheckpoint implements Source.
func (r *remote) ExportCheckpoint(ctx context.Context, name string) (*api.CheckpointExport, error) {
	resp, err := r.get(ctx, "/v1/checkpoints/"+url.PathEscape(name)+"/export", "")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var out api.CheckpointExport
	body := progressReader{r: io.LimitReader(resp.Body, 256<<20), touch: progressOf(ctx)}
	if err := json.NewDecoder(body).Decode(&out); err != nil {
		return nil, fmt.Errorf("%w: export of %s: %v", api.ErrProtocol, name, err)
	}
	return &out, nil
}

// ReadCheckpointFile implements Source: one Range request, which must be answered with
// exactly that range.
func (r *remote) ReadCheckpointFile(ctx context.Context, name, file string, off, n int64) (io.ReadCloser, error) {
	if off < 0 || n <= 0 {
		return nil, fmt.Errorf("%w: range %d+%d", api.ErrInvalidSpec, off, n)
	}
	resp, err := r.get(ctx, filePath(name, file), "bytes="+byteSpan(off, n))
	if err != nil {
		return nil, err
	}
	if err := CheckRange(resp, off, n); err != nil {
		resp.Body.Close()
		return nil, fmt.Errorf("%s of %s: %w", file, name, err)
	}
	return progressBody{progressReader{r: resp.Body, touch: progressOf(ctx)}, resp.Body}, nil
}

// ReadCheckpointFileRanges implements RangesSource: one Range request for every range
// of rs, which must be answered with exactly them, in order (multipart/byteranges, or
// for one range a plain 206).
func (r *remote) ReadCheckpointFileRanges(ctx context.Context, name, file string, rs []api.Extent, each func(api.Extent, io.Reader) error) error {
	if len(rs) == 0 {
		return nil
	}
	var rng strings.Builder
	rng.WriteString("bytes=")
	for i, x := range rs {
		if x.Off < 0 || x.Len <= 0 {
			return fmt.Errorf("%w: range %d+%d", api.ErrInvalidSpec, x.Off, x.Len)
		}
		if i > 0 {
			rng.WriteByte(',')
		}
		rng.WriteString(byteSpan(x.Off, x.Len))
	}
	resp, err := r.get(ctx, filePath(name, file), rng.String())
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body := progressReader{r: resp.Body, touch: progressOf(ctx)}
	if len(rs) == 1 {
		if err := CheckRange(resp, rs[0].Off, rs[0].Len); err != nil {
			return fmt.Errorf("%s of %s: %w", file, name, err)
		}
		return each(rs[0], body)
	}
	mt, params, err := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if resp.StatusCode != http.StatusPartialContent || err != nil || mt != "multipart/byteranges" || params["boundary"] == "" {
		return fmt.Errorf("%w: %s of %s: asked %d ranges, got HTTP %d %q", api.ErrProtocol, file, name, len(rs), resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	mr := multipart.NewReader(body, params["boundary"])
	for _, x := range rs {
		part, err := mr.NextPart()
		if err != nil {
			return fmt.Errorf("%w: %s of %s: part for bytes %d+%d: %v", api.ErrProtocol, file, name, x.Off, x.Len, err)
		}
		want := "bytes " + byteSpan(x.Off, x.Len) + "/"
		if cr := part.Header.Get("Content-Range"); !strings.HasPrefix(cr, want) {
			return fmt.Errorf("%w: %s of %s: asked bytes %d+%d, got part %q", api.ErrProtocol, file, name, x.Off, x.Len, cr)
		}
		if err := each(x, io.LimitReader(part, x.Len)); err != nil {
			return err
		}
		if n, _ := part.Read(make([]byte, 1)); n > 0 {
			return fmt.Errorf("%w: %s of %s: part for bytes %d+%d is longer", api.ErrProtocol, file, name, x.Off, x.Len)
		}
	}
	if _, err := mr.NextPart(); err != io.EOF {
		return fmt.Errorf("%w: %s of %s: more than the %d parts asked (%v)", api.ErrProtocol, file, name, len(rs), err)
	}
	return nil
}

// CheckRange checks that resp answers a Range request for n bytes at off with exactly
// them (206, Content-Range, Content-Length); api.ErrProtocol otherwise.
func CheckRange(resp *http.Response, off, n int64) error {
	want := "bytes " + byteSpan(off, n) + "/"
	if cr := resp.Header.Get("Content-Range"); resp.StatusCode != http.StatusPartialContent || !strings.HasPrefix(cr, want) || resp.ContentLength != n {
		return fmt.Errorf("%w: asked bytes %d+%d, got HTTP %d %q (%d bytes)", api.ErrProtocol, off, n, resp.StatusCode, cr, resp.ContentLength)
	}
	return nil
}

// filePath is the API path of file of checkpoint name's export.
func filePath(name, file string) string {
	return "/v1/checkpoints/" + url.PathEscape(name) + "/export/file?name=" + url.QueryEscape(file)
}

// byteSpan is the n bytes at off as a Range or Content-Range writes them ("A-B").
func byteSpan(off, n int64) string {
	return strconv.FormatInt(off, 10) + "-" + strconv.FormatInt(off+n-1, 10)
}
