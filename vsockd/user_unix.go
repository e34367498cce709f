//go:build unix

package vsockd

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
)

// The guest's user database, read the way a static binary must (no NSS): the agent
// parses /etc/passwd and /etc/group itself.
var (
	passwdFile = "/etc/passwd"
	groupFile  = "/etc/group"
)

// execUser is who an exec runs as.
type execUser struct {
	uid, gid uint32
	groups   []uint32 // supplementary groups (possibly empty: root's are dropped)
	name     string   // "" for a uid without a passwd entry
	home     string
}

// passwdEntry is one line of /etc/passwd.
type passwdEntry struct {
	name     string
	uid, gid uint32
	home     string
}

// groupEntry is one line of /etc/group.
type groupEntry struct {
	name    string
	gid     uint32
	members []string
}

// readColonFile calls fn with the fields of each well-formed line of the colon-separated
// file path (at least n fields); a missing file has no lines.
func readColonFile(path string, n int, fn func(f []string)) error {
	file, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer file.Close()
	sc := bufio.NewScanner(file)
	sc.Buffer(make([]byte, 4096), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Split(line, ":")
		if len(f) >= n {
			fn(f)
		}
	}
	return sc.Err()
}

// parseID parses a numeric uid or gid; 4294967295 is (uid_t)-1, which set*id read as
// "unchanged", so it is no id.
func parseID(s string) (uint32, bool) {
	n, err := strconv.ParseUint(s, 10, 32)
	return uint32(n), err == nil && n != 1<<32-1
}

func readPasswd(path string) ([]passwdEntry, error) {
	var out []passwdEntry
	err := readColonFile(path, 7, func(f []string) {
		uid, ok1 := parseID(f[2])
		gid, ok2 := parseID(f[3])
		if ok1 && ok2 && f[0] != "" {
			out = append(out, passwdEntry{name: f[0], uid: uid, gid: gid, home: f[5]})
		}
	})
	return out, err
}

func readGroup(path string) ([]groupEntry, error) {
	var out []groupEntry
	err := readColonFile(path, 4, func(f []string) {
		gid, ok := parseID(f[2])
		if !ok || f[0] == "" {
			return
		}
		var members []string
		for _, m := range strings.Split(f[3], ",") {
			if m = strings.TrimSpace(m); m != "" {
				members = append(members, m)
			}
		}
		out = append(out, groupEntry{name: f[0], gid: gid, members: members})
	})
	return out, err
}

// lookupUser resolves USER[:GROUP] (names or numeric ids) against the passwd and group
// files. A name is looked up first, so a user named "1000" is found by name; a number
// that is no name is a uid (or gid), which need not have an entry: a uid without one
// gets gid = uid, HOME=/ and no supplementary groups. Unknown names fail with an
// *execError of CodeUser naming them, a malformed spec (an empty part, a second colon:
// no user or group name holds one) with one saying so rather than naming a part.
func lookupUser(spec, passwdPath, groupPath string) (*execUser, error) {
	userPart, groupPart, hasGroup := strings.Cut(spec, ":")
	if userPart == "" || (hasGroup && groupPart == "") || strings.Contains(groupPart, ":") {
		return nil, &execError{CodeUser, fmt.Sprintf("bad user %q (want USER[:GROUP])", spec)}
	}
	users, err := readPasswd(passwdPath)
	if err != nil {
		return nil, &execError{CodeExec, fmt.Sprintf("reading %s: %v", passwdPath, err)}
	}
	u := &execUser{home: "/"}
	found := false
	for _, e := range users {
		if e.name == userPart {
			u.uid, u.gid, u.name, u.home, found = e.uid, e.gid, e.name, e.home, true
			break
		}
	}
	if !found {
		uid, ok := parseID(userPart)
		if !ok {
			return nil, &execError{CodeUser, fmt.Sprintf("unknown user %q (not in the guest's %s)", userPart, passwdPath)}
		}
		u.uid, u.gid = uid, uid
		for _, e := range users {
			if e.uid == uid {
				u.gid, u.name, u.home = e.gid, e.name, e.home
				break
			}
		}
	}
	if u.home == "" {
		u.home = "/"
	}
	groups, err := readGroup(groupPath)
	if err != nil {
		return nil, &execError{CodeExec, fmt.Sprintf("reading %s: %v", groupPath, err)}
	}
	if hasGroup {
		found := false
		for _, g := range groups {
			if g.name == groupPart {
				u.gid, found = g.gid, true
				break
			}
		}
		if !found {
			gid, ok := parseID(groupPart)
			if !ok {
				return nil, &execError{CodeUser, fmt.Sprintf("unknown group %q (not in the guest's %s)", groupPart, groupPath)}
			}
			u.gid = gid
		}
	}
	u.groups = []uint32{}
	if u.name != "" {
		seen := map[uint32]bool{}
		for _, g := range groups {
			for _, m := range g.members {
				if m == u.name && !seen[g.gid] {
					seen[g.gid] = true
					u.groups = append(u.groups, g.gid)
				}
			}
		}
	}
	return u, nil
}
