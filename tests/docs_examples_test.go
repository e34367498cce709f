package tests

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/serve"
)

// docLine is one command of the README's indented blocks: the shell line as written
// (continuations joined) and what its comment promises.
type docLine struct {
	text       string
	wantOut    string // "# prints X": stdout's first line is X ("" : not checked)
	wantCode   int    // "exits N"
	skipReason string
}

// readmeSkips are the README lines this test cannot run here, each with why. A line no
// rule matches is run: a new example is checked as soon as it is written.
var readmeSkips = []struct {
	re     *regexp.Regexp
	reason string
}{
	{regexp.MustCompile(`^make `), "the set-up itself (make)"},
	{regexp.MustCompile(`^export `), "the shell's PATH (the test puts the built CLI first on it)"},
	{regexp.MustCompile(`exec -t `), "an interactive terminal: a person types in it (TestServeCLI drives one with script(1))"},
	{regexp.MustCompile(`--fleet|forkvm nodes|--cluster|checkpoint pull`), "a fleet: other daemons joined over NATS, other hosts (TestFleet*, TestPull* cover it)"},
	{regexp.MustCompile(`--debian|--image deb|exec d1 `), "a Debian root image built with mmdebstrap and apt: minutes (TestImage* cover it)"},
}

// readmeLines extracts the forkvm command lines of README.md's indented blocks.
func readmeLines(t *testing.T) []docLine {
	b, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	prints := regexp.MustCompile(`#\s*prints (\S+?)[,\s(]`)
	exits := regexp.MustCompile(`exits (\d+)`)
	var out []docLine
	inFence := false
	lines := strings.Split(string(b), "\n")
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		if strings.HasPrefix(l, "```") {
			inFence = !inFence
			continue
		}
		if inFence || !strings.HasPrefix(l, "    ") {
			continue
		}
		text := strings.TrimSpace(l)
		for strings.HasSuffix(text, `\`) && i+1 < len(lines) {
			i++
			text = strings.TrimSuffix(text, `\`) + " " + strings.TrimSpace(lines[i])
		}
		if !strings.HasPrefix(text, "forkvm ") && !strings.HasPrefix(text, "make ") && !strings.HasPrefix(text, "export ") {
			continue
		}
		d := docLine{text: text}
		if m := prints.FindStringSubmatch(text + " "); m != nil {
			d.wantOut = m[1]
		}
		if m := exits.FindStringSubmatch(text); m != nil {
			d.wantCode, _ = strconv.Atoi(m[1])
		}
		for _, s := range readmeSkips {
			if s.re.MatchString(text) {
				d.skipReason = s.reason
				break
			}
		}
		out = append(out, d)
	}
	return out
}

// docBody is a request body of docs/api.md: the endpoint's heading and the JSON after
// its "Body".
type docBody struct {
	method, path, body string
}

// apiBodies extracts docs/api.md's request bodies: the JSON block or inline JSON that
// follows "Body" under an endpoint's heading.
func apiBodies(t *testing.T) []docBody {
	b, err := os.ReadFile(filepath.Join(repoRoot, "docs", "api.md"))
	if err != nil {
		t.Fatal(err)
	}
	heading := regexp.MustCompile("^### `([A-Z|]+) ([^`]+)`")
	inline := regexp.MustCompile("Body:?[^`]*`(\\{[^`]*\\})`")
	var out []docBody
	var method, path string
	lines := strings.Split(string(b), "\n")
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		if m := heading.FindStringSubmatch(l); m != nil {
			method, path = m[1], m[2]
			continue
		}
		if strings.HasPrefix(l, "## ") {
			method, path = "", ""
		}
		if method == "" || !strings.Contains(l, "Body") {
			continue
		}
		// Inline bodies may continue on the next line.
		if m := inline.FindStringSubmatch(l + " " + lines[min(i+1, len(lines)-1)]); m != nil {
			out = append(out, docBody{method, path, m[1]})
			continue
		}
		for j := i + 1; j < len(lines) && j < i+4; j++ {
			if lines[j] == "```json" {
				var body []string
				for j++; j < len(lines) && lines[j] != "```"; j++ {
					body = append(body, lines[j])
				}
				out = append(out, docBody{method, path, strings.Join(body, "\n")})
				break
			}
		}
	}
	return out
}

// TestDocsExamples runs the README's CLI lines, in order, as written (sh -c, the built
// CLI first on PATH), against a daemon, and checks what their comments promise (prints
// X, exits N); then it sends docs/api.md's request bodies to their endpoints on the
// daemon's socket. Lines that need what this host lacks or a fleet are skipped, named,
// with the reason. The VMs are the README's own, shared between lines as it shares them.
func TestDocsExamples(t *testing.T) {
	lines := readmeLines(t)
	bodies := apiBodies(t)
	if len(lines) < 20 || len(bodies) < 4 {
		t.Fatalf("extracted %d README lines and %d api.md bodies: the extraction no longer matches the docs", len(lines), len(bodies))
	}
	home, err := os.MkdirTemp("/tmp", "fvdoc-")
	if err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	cli := cliRunner(t, home)
	t.Cleanup(func() {
		cli(nil, "rm", "w1", "f1", "f2", "web", "g1", "g2", "g3", "g4", "g5", "g6", "g7", "g8")
		cli(nil, "checkpoint", "rm", "--force", "ck1", "webck")
		for pid, args := range procsReferencing(home) {
			t.Errorf("leak: process %d still references %s: %q", pid, home, args)
		}
		os.RemoveAll(home)
	})
	// What the README's cp lines copy: a project with the out.bin it copies back.
	payload := make([]byte, 64<<10)
	rand.Read(payload)
	if err := os.MkdirAll(filepath.Join(work, "project"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(work, "project", "out.bin"), payload, 0o644); err != nil {
		t.Fatal(err)
	}
	sock := serve.SocketPath(home)
	// The README's wave asks for --overcommit 16 itself; the daemon's own budget is
	// raised for other tests' VMs on this host.
	daemon := startDaemon(t, home, sock, filepath.Join(t.TempDir(), "daemon.log"), "--overcommit", "32")
	defer daemon.stop()

	netSkip := netPortsBusy(8080, 8081, 9100, 9101, 9102, 9103)
	if netSkip == "" {
		stop, err := serveHTTP("127.0.0.1:9000", "from the host\n")
		if err != nil {
			netSkip = fmt.Sprintf("127.0.0.1:9000 free, which another program on this host holds (%v)", err)
		} else {
			defer stop()
		}
	}
	start := time.Now()
	for _, d := range lines {
		if d.skipReason == "" && netSkip != "" && strings.Contains(d.text, "web") {
			d.skipReason = netSkip
		}
		if d.skipReason != "" {
			t.Logf("skipped: %s\n    needs %s", d.text, d.skipReason)
			continue
		}
		t0 := time.Now()
		cmd := exec.Command("sh", "-c", d.text)
		cmd.Dir = work
		cmd.Env = append(os.Environ(), "PATH="+binDir+":"+os.Getenv("PATH"), "FORKVM_HOME="+home, "FORKVM_CACHE="+cacheDir)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		first, _, _ := strings.Cut(stdout.String(), "\n")
		if code != 0 && strings.Contains(d.text, "--publish") && strings.Contains(stderr.String(), "host port already in use") {
			// Another program on this shared host took the port since it was found free.
			netSkip = "its published ports free: " + strings.TrimSpace(stderr.String())
			t.Logf("skipped: %s\n    needs %s", d.text, netSkip)
			continue
		}
		if code != d.wantCode || (d.wantOut != "" && first != d.wantOut) {
			t.Fatalf("README line failed as written: %s\n  exit %d (want %d), stdout %q (want first line %q)\n  stderr: %s",
				d.text, code, d.wantCode, stdout.String(), d.wantOut, stderr.String())
		}
		t.Logf("ok in %v: %s", time.Since(t0).Round(time.Millisecond), d.text)
	}
	if got, err := os.ReadFile(filepath.Join(work, "out.bin")); err != nil || !bytes.Equal(got, payload) {
		t.Errorf("the README's cp round trip: %d bytes back, %v", len(got), err)
	}
	t.Logf("README lines: %v", time.Since(start).Round(time.Millisecond))
	// The README's networking block leaves its VMs running (as a user would); the
	// api.md examples start afresh with the names they use (w1, ck1, g1..g8).
	cli(nil, "rm", "web", "f1", "g1", "g2", "g3", "g4")
	cli(nil, "checkpoint", "rm", "--force", "webck")

	start = time.Now()
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	for _, b := range bodies {
		path := strings.ReplaceAll(b.path, "{name}", apiName(b.path))
		if strings.Contains(path, "/pull") {
			t.Logf("skipped: %s %s %s\n    needs another daemon to pull from (TestPull* cover it)", b.method, path, b.body)
			continue
		}
		if !json.Valid([]byte(b.body)) {
			t.Errorf("docs/api.md's body for %s %s is not JSON: %s", b.method, b.path, b.body)
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		req, _ := http.NewRequestWithContext(ctx, b.method, "http://forkvm"+path, strings.NewReader(b.body))
		req.Header.Set("Content-Type", "application/json")
		resp, err := hc.Do(req)
		if err != nil {
			cancel()
			t.Fatalf("%s %s: %v", b.method, path, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		cancel()
		if resp.StatusCode/100 != 2 || bytes.Contains(body, []byte(`"error"`)) || bytes.Contains(body, []byte(`"ok":false`)) {
			t.Fatalf("docs/api.md's body failed as written: %s %s %s\n  %d: %s", b.method, path, b.body, resp.StatusCode, body)
		}
		t.Logf("ok %d: %s %s", resp.StatusCode, b.method, path)
		if strings.HasSuffix(path, "/exec") {
			checkExecStream(t, body)
		}
	}
	t.Logf("api.md bodies: %v", time.Since(start).Round(time.Millisecond))
}

// apiName is the resource name a path's {name} stands for in docs/api.md's examples:
// its bodies make w1, checkpoint it as ck1 and fork ck1.
func apiName(path string) string {
	if strings.HasPrefix(path, "/v1/checkpoints/") {
		return "ck1"
	}
	return "w1"
}

// checkExecStream checks docs/api.md's exec example's stream: "hi" on stdout, exit 3.
func checkExecStream(t *testing.T, stream []byte) {
	t.Helper()
	var out []byte
	code := -1
	sc := bufio.NewScanner(bytes.NewReader(stream))
	for sc.Scan() {
		var l struct {
			Stdout   []byte `json:"stdout"`
			ExitCode *int   `json:"exit_code"`
		}
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("exec stream line %q: %v", sc.Text(), err)
		}
		out = append(out, l.Stdout...)
		if l.ExitCode != nil {
			code = *l.ExitCode
		}
	}
	if string(out) != "hi\n" || code != 3 {
		t.Errorf("docs/api.md's exec example: stdout %q exit %d, want \"hi\\n\" and 3", out, code)
	}
}

// netPortsBusy is why the README's networking lines cannot run here ("" when they can):
// a loopback port they publish or serve on that something else on this shared host
// holds.
func netPortsBusy(ports ...int) string {
	for _, p := range ports {
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			return fmt.Sprintf("127.0.0.1:%d free, which another program on this host holds", p)
		}
		l.Close()
	}
	return ""
}

// serveHTTP serves body on addr (the host's server the README's networking example
// fetches from the guest) until the returned stop is called.
func serveHTTP(addr, body string) (func(), error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, body) })}
	go srv.Serve(l)
	return func() { srv.Close() }, nil
}

// TestREADMEGoBlock: the README's Go API block compiles as written, in a main function
// with a ctx, and the tar stream and writer it names (the only names it leaves to the
// reader); its results left unused are all the compiler may say.
func TestREADMEGoBlock(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "\n```go\n")
	block, _, ok2 := strings.Cut(rest, "\n```\n")
	if !ok || !ok2 || !strings.Contains(block, "engine.New(") {
		t.Fatal("README.md has no Go block with engine.New")
	}
	src := "package main\n\nimport (\n\t\"context\"\n\t\"errors\"\n\t\"io\"\n\t\"os\"\n\n" +
		"\t\"github.com/forkvm/forkvm/engine\"\n\t\"github.com/forkvm/forkvm/vsockd\"\n)\n\n" +
		"func main() {\n\tctx := context.Background()\n\tvar tarStream io.Reader\n\tvar w io.Writer\n" + block + "\n}\n"
	dir := t.TempDir()
	file := filepath.Join(dir, "main.go")
	if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	// An overlay puts the file in a package of the module without writing into it.
	overlay, _ := json.Marshal(map[string]any{"Replace": map[string]string{filepath.Join(repoRoot, "tests", "readmego", "main.go"): file}})
	ov := filepath.Join(dir, "overlay.json")
	if err := os.WriteFile(ov, overlay, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", "build", "-gcflags=-e", "-overlay", ov, "-o", os.DevNull, "./tests/readmego")
	cmd.Dir = repoRoot
	out, err := cmd.CombinedOutput()
	if err == nil {
		return
	}
	var bad []string
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if strings.HasPrefix(l, "#") || strings.Contains(l, "declared and not used") || strings.Contains(l, "imported and not used") {
			continue
		}
		bad = append(bad, l)
	}
	if len(bad) > 0 || !strings.Contains(string(out), "not used") {
		t.Errorf("README.md's Go block does not compile: %v\n%s\n%s", err, out, src)
	}
}
