package serve

import (
	"bufio"
	"os"
	"strconv"
	"strings"

	"github.com/forkvm/forkvm/api"
)

// connectedPorts reports whether a TCP connection is established on one of the host
// ports pubs publish: the VM's QEMU accepted it (its user-mode network relays it into
// the guest), so the VM is in use. It reads /proc/net/tcp; the daemon sees connections,
// not the bytes on them, so an established but silent connection counts as use.
func connectedPorts(pubs []api.PortForward) bool {
	if len(pubs) == 0 {
		return false
	}
	want := map[int]bool{}
	for _, p := range pubs {
		want[p.HostPort] = true
	}
	return establishedOn("/proc/net/tcp", want)
}

// establishedOn reports whether the table (the format of /proc/net/tcp) has an
// established connection whose local port is in ports.
func establishedOn(table string, ports map[int]bool) bool {
	f, err := os.Open(table)
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Scan() // the header
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 4 || fields[3] != "01" { // TCP_ESTABLISHED
			continue
		}
		_, port, ok := strings.Cut(fields[1], ":")
		if !ok {
			continue
		}
		n, err := strconv.ParseUint(port, 16, 16)
		if err == nil && ports[int(n)] {
			return true
		}
	}
	return false
}
