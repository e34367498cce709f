package main

import (
	"errors"
	"reflect"
	"testing"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/engine"
)

func TestParsePublish(t *testing.T) {
	for _, tc := range []struct {
		specs  []string
		offset int
		want   []engine.PortForward
		bad    bool
	}{
		{specs: nil, want: nil},
		{specs: []string{"8080:80"}, want: []engine.PortForward{{HostPort: 8080, GuestPort: 80}}},
		{specs: []string{"8080:80", "0.0.0.0:2222:22"}, offset: 3,
			want: []engine.PortForward{{HostPort: 8083, GuestPort: 80}, {HostIP: "0.0.0.0", HostPort: 2225, GuestPort: 22}}},
		{specs: []string{"65535:80"}, offset: 0, want: []engine.PortForward{{HostPort: 65535, GuestPort: 80}}},
		{specs: []string{"65535:80"}, offset: 1, bad: true}, // a wave past the last port
		{specs: []string{"80"}, bad: true},
		{specs: []string{"8080:80", "127.0.0.1,hostfwd=tcp::22-:22:1:2"}, bad: true},
		{specs: []string{"localhost:8080:80"}, bad: true},
		{specs: []string{"[::1]:8080:80"}, bad: true},
		{specs: []string{"8080:80:"}, bad: true},
	} {
		got, err := parsePublish(tc.specs, tc.offset)
		if tc.bad {
			if !errors.Is(err, engine.ErrInvalidSpec) {
				t.Errorf("parsePublish(%q, %d) = %v, %v; want ErrInvalidSpec", tc.specs, tc.offset, got, err)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("parsePublish(%q, %d) = %v, %v; want %v", tc.specs, tc.offset, got, err, tc.want)
		}
	}
}

// TestNamesNeverReadAsSubcommands: a VM named like a help or rm subcommand is refused by
// the commands that make names, and no command below the top level has a help
// subcommand that a name could be taken for.
func TestNamesNeverReadAsSubcommands(t *testing.T) {
	if err := checkNewName("rm"); !errors.Is(err, engine.ErrInvalidName) {
		t.Errorf("checkNewName(rm) = %v, want ErrInvalidName", err)
	}
	for _, n := range []string{"w1", "h", "help"} { // no help subcommand to collide with
		if err := checkNewName(n); err != nil {
			t.Errorf("checkNewName(%q) = %v", n, err)
		}
	}
	var walk func(c *cli.Command, top bool)
	walk = func(c *cli.Command, top bool) {
		if !top && !c.HideHelpCommand {
			t.Errorf("command %s keeps a help subcommand", c.Name)
		}
		for _, sub := range c.Commands {
			walk(sub, false)
		}
	}
	walk(newApp(), true)
}
