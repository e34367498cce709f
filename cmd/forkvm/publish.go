package main

import (
	"fmt"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/engine"
)

// publishFlag is the repeatable --publish [HOSTIP:]HOSTPORT:GUESTPORT flag.
func publishFlag(usage string) cli.Flag {
	return &cli.StringSliceFlag{Name: "publish", Aliases: []string{"p"}, Usage: usage + "; `PORTS` is [HOSTIP:]HOSTPORT:GUESTPORT"}
}

// parsePublish parses --publish values, each host port shifted by offset (the index of
// a fork in a wave).
func parsePublish(specs []string, offset int) ([]engine.PortForward, error) {
	var out []engine.PortForward
	for _, s := range specs {
		p, err := engine.ParsePortForward(s)
		if err != nil {
			return nil, err
		}
		p.HostPort += offset
		if err := p.Validate(); err != nil {
			return nil, fmt.Errorf("--publish %s for fork %d: %w", s, offset, err)
		}
		out = append(out, p)
	}
	return out, nil
}
