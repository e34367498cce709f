package local

import (
	"bufio"
	"os"
	"strings"
)

// socketHeld reports whether the unix socket listening at path has accepted a
// connection that is still open: in /proc/net/unix (Linux) an accepted socket carries
// its listener's path in state 03 (connected). QEMU's chardev server accepts one client
// at a time; a second client's connect succeeds into the backlog and then waits
// unanswered, which is what this check avoids. Where /proc/net/unix cannot be read it
// reports false (the dial's timeout then applies).
func socketHeld(path string) bool {
	f, err := os.Open("/proc/net/unix")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// Num RefCount Protocol Flags Type St Inode Path
		fields := strings.Fields(sc.Text())
		if len(fields) >= 8 && fields[5] == "03" && strings.Join(fields[7:], " ") == path {
			return true
		}
	}
	return false
}
