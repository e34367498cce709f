//go:build linux

package vsockd

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// fakeUserDB points the agent's user database at test files until the test ends.
func fakeUserDB(t *testing.T) (passwd, group string) {
	t.Helper()
	dir := t.TempDir()
	passwd, group = filepath.Join(dir, "passwd"), filepath.Join(dir, "group")
	os.WriteFile(passwd, []byte("# users\nroot:x:0:0:root:/root:/bin/sh\n"+
		"tester:x:4242:4243:Test User:/home/tester:/bin/sh\n"+
		"nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"+
		"1000:x:1001:1001::/home/digits:/bin/sh\n"+
		"broken line\n"), 0o644)
	os.WriteFile(group, []byte("root:x:0:\ntester:x:4243:\nextra:x:5000:alice,tester\n"+
		"more:x:5001:tester\nnogroup:x:65534:\n"), 0o644)
	oldP, oldG := passwdFile, groupFile
	passwdFile, groupFile = passwd, group
	t.Cleanup(func() { passwdFile, groupFile = oldP, oldG })
	return passwd, group
}

func TestLookupUser(t *testing.T) {
	passwd, group := fakeUserDB(t)
	for _, tc := range []struct {
		spec     string
		uid, gid uint32
		groups   []uint32
		home     string
		err      string
	}{
		{spec: "tester", uid: 4242, gid: 4243, groups: []uint32{5000, 5001}, home: "/home/tester"},
		{spec: "4242", uid: 4242, gid: 4243, groups: []uint32{5000, 5001}, home: "/home/tester"},
		{spec: "tester:extra", uid: 4242, gid: 5000, groups: []uint32{5000, 5001}, home: "/home/tester"},
		{spec: "tester:77", uid: 4242, gid: 77, groups: []uint32{5000, 5001}, home: "/home/tester"},
		{spec: "nobody", uid: 65534, gid: 65534, groups: []uint32{}, home: "/nonexistent"},
		{spec: "7777", uid: 7777, gid: 7777, groups: []uint32{}, home: "/"},
		{spec: "7777:nogroup", uid: 7777, gid: 65534, groups: []uint32{}, home: "/"},
		{spec: "1000", uid: 1001, gid: 1001, groups: []uint32{}, home: "/home/digits"}, // a name first
		{spec: "root", uid: 0, gid: 0, groups: []uint32{}, home: "/root"},
		{spec: "bob", err: `unknown user "bob"`},
		{spec: "tester:nosuch", err: `unknown group "nosuch"`},
		{spec: "", err: "bad user"},
		{spec: "tester:", err: "bad user"},
		{spec: ":0", err: "bad user"},
		{spec: "a:b:c", err: "bad user"},
		{spec: "tester:extra:x", err: "bad user"},
		{spec: "0:0:", err: "bad user"},
		{spec: "-1", err: `unknown user "-1"`},
		{spec: "4294967295", err: `unknown user "4294967295"`}, // (uid_t)-1 is "unchanged"
		{spec: "tester:4294967295", err: `unknown group "4294967295"`},
	} {
		u, err := lookupUser(tc.spec, passwd, group)
		if tc.err != "" {
			var ee *execError
			if !errors.As(err, &ee) || ee.code != CodeUser || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: %v, want a %s error with %q", tc.spec, err, CodeUser, tc.err)
			}
			continue
		}
		if err != nil || u.uid != tc.uid || u.gid != tc.gid || !slices.Equal(u.groups, tc.groups) || u.home != tc.home {
			t.Errorf("%q: %+v %v, want %d:%d %v %s", tc.spec, u, err, tc.uid, tc.gid, tc.groups, tc.home)
		}
	}
	// No passwd file at all: numeric ids still work, names do not.
	if u, err := lookupUser("5", "/nonexistent/passwd", "/nonexistent/group"); err != nil || u.uid != 5 || u.gid != 5 {
		t.Errorf("numeric without passwd: %+v %v", u, err)
	}
	if _, err := lookupUser("tester", "/nonexistent/passwd", group); err == nil {
		t.Error("a name without passwd was found")
	}
}

func TestExecUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("running as another user needs root")
	}
	fakeUserDB(t)
	c := pair(t, nil)
	run := func(user string) (string, error) {
		var out, errb bytes.Buffer
		code, err := c.Run(tctx(t), &ExecRequest{User: user, Stdout: &out, Stderr: &errb,
			Argv: []string{"sh", "-c", `echo $(id -u) $(id -g) $(id -G) "$HOME" "$USER"`}})
		if err == nil && code != 0 {
			t.Fatalf("%s: exit %d: %s", user, code, errb.String())
		}
		return strings.TrimSpace(out.String()), err
	}
	for _, tc := range []struct{ user, want string }{
		{"tester", "4242 4243 4243 5000 5001 /home/tester tester"},
		{"7777:5000", "7777 5000 5000 /"},
		{"nobody", "65534 65534 65534 /nonexistent nobody"},
		{"", "0 0 "}, // root keeps the agent's groups: only the prefix is checked
	} {
		got, err := run(tc.user)
		if err != nil || (got != tc.want && (tc.user != "" || !strings.HasPrefix(got, tc.want))) {
			t.Errorf("user %q: %q %v, want %q", tc.user, got, err, tc.want)
		}
	}
	if _, err := run("bob"); !errors.Is(err, ErrUnknownUser) || !strings.Contains(err.Error(), "bob") {
		t.Errorf("unknown user: %v", err)
	}
	// The user's HOME can be overridden; a TTY works too.
	var out bytes.Buffer
	code, err := c.Run(tctx(t), &ExecRequest{User: "tester", TTY: true, Env: []string{"HOME=/tmp"}, Stdout: &out,
		Argv: []string{"sh", "-c", `echo $(id -u) $HOME; stat -c %u $(tty)`}})
	if err != nil || code != 0 || !strings.Contains(out.String(), "4242 /tmp") || !strings.Contains(out.String(), "\n4242") {
		t.Fatalf("tty exec as tester: %d %v %q", code, err, out.String())
	}
}

// TestExecWorkdirForUser: a working directory the user cannot enter is ErrWorkdir
// naming the directory and the user (the agent checks as root, and a failed chdir in
// the child reads like a failed execve: "pwd: permission denied"); one it can enter,
// through its group or as other, runs.
func TestExecWorkdirForUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("running as another user needs root")
	}
	fakeUserDB(t)
	c := pair(t, nil)
	base := t.TempDir()
	os.Chmod(filepath.Dir(base), 0o755) // t.TempDir makes both 0700
	os.Chmod(base, 0o755)
	mk := func(name string, mode os.FileMode, gid int) string {
		d := filepath.Join(base, name)
		if err := os.Mkdir(d, mode); err != nil {
			t.Fatal(err)
		}
		os.Chmod(d, mode)
		if err := os.Chown(d, 0, gid); err != nil {
			t.Fatal(err)
		}
		return d
	}
	private := mk("private", 0o700, 0)
	inner := filepath.Join(private, "inner")
	os.Mkdir(inner, 0o755)
	group := mk("group", 0o710, 5000) // tester is in 5000 as a supplementary group
	open := mk("open", 0o711, 0)
	for _, tc := range []struct {
		user, dir string
		ok        bool
	}{
		{"tester", private, false},
		{"tester", inner, false}, // searchable itself, under one that is not
		{"nobody", group, false},
		{"tester", group, true},
		{"nobody", open, true},
		{"", private, true}, // root
		{"0", private, true},
	} {
		var out bytes.Buffer
		code, err := c.Run(tctx(t), &ExecRequest{User: tc.user, Dir: tc.dir, Argv: []string{"pwd"}, Stdout: &out})
		if tc.ok {
			if err != nil || code != 0 || strings.TrimSpace(out.String()) != tc.dir {
				t.Errorf("user %q in %s: %d %v %q", tc.user, tc.dir, code, err, out.String())
			}
			continue
		}
		if !errors.Is(err, ErrWorkdir) || errors.Is(err, ErrNotExecutable) || code != -1 ||
			!strings.Contains(err.Error(), tc.dir) || !strings.Contains(err.Error(), tc.user) || strings.Contains(err.Error(), "pwd") {
			t.Errorf("user %q in %s: %d %v, want ErrWorkdir naming the directory and the user", tc.user, tc.dir, code, err)
		}
	}
}
