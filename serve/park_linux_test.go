package serve

import (
	"os"
	"path/filepath"
	"testing"
)

// TestEstablishedOn: only an established connection whose local port is a published one
// counts as use of the VM; listening sockets and other ports do not.
func TestEstablishedOn(t *testing.T) {
	const header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
	rows := map[string]string{
		"listen": "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1 1 0 100 0 0 10 0\n",
		"est":    "   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000  1000        0 2 1 0 20 4 30 10 -1\n",
		"other":  "   2: 0100007F:1F91 0100007F:D432 01 00000000:00000000 00:00000000 00000000  1000        0 3 1 0 20 4 30 10 -1\n",
		"remote": "   3: 0100007F:D433 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1000        0 4 1 0 20 4 30 10 -1\n",
	}
	cases := []struct {
		rows []string
		want bool
	}{
		{nil, false},
		{[]string{"listen"}, false},
		{[]string{"listen", "other"}, false},
		{[]string{"remote"}, false},
		{[]string{"listen", "est"}, true},
	}
	for _, c := range cases {
		table := header
		for _, r := range c.rows {
			table += rows[r]
		}
		p := filepath.Join(t.TempDir(), "tcp")
		if err := os.WriteFile(p, []byte(table), 0o600); err != nil {
			t.Fatal(err)
		}
		if got := establishedOn(p, map[int]bool{8080: true}); got != c.want {
			t.Errorf("%v: %v, want %v", c.rows, got, c.want)
		}
	}
}
