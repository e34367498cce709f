package main

import (
	"fmt"
	"strings"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// publishFlag is the repeatable --publish [HOSTIP:]HOSTPORT:GUESTPORT flag.
func publishFlag(usage string) cli.Flag {
	return &cli.StringSliceFlag{Name: "publish", Aliases: []string{"p"}, Usage: usage + "; `PORTS` is [HOSTIP:]HOSTPORT:GUESTPORT"}
}

// parsePublish parses --publish values for fork offset of a wave (api.WaveForwards).
func parsePublish(specs []string, offset int) ([]engine.PortForward, error) {
	var pubs []engine.PortForward
	for _, s := range specs {
		p, err := engine.ParsePortForward(s)
		if err != nil {
			return nil, err
		}
		pubs = append(pubs, p)
	}
	out, err := api.WaveForwards(pubs, offset)
	if err != nil {
		return nil, fmt.Errorf("--publish %s: %w", strings.Join(specs, ","), err)
	}
	return out, nil
}
