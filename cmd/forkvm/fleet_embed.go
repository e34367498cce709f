//go:build !nofleetserver

package main

import (
	"context"
	"fmt"
	"log/slog"
	"strings"

	"github.com/forkvm/forkvm/fleet/natsembed"
)

// startEmbedded starts the NATS server embedded in the daemon (--cluster-listen). A
// binary built with the tag nofleetserver links no server and refuses it.
func startEmbedded(ctx context.Context, o embedOptions, log *slog.Logger) (embeddedServer, error) {
	s, err := natsembed.Start(ctx, natsembed.Config{Name: o.node, StoreDir: o.dir, ClusterListen: o.listen, ClientListen: o.clientListen,
		Routes: o.routes, User: o.user, Password: o.password, Insecure: o.insecure,
		CertFile: o.tls.cert, KeyFile: o.tls.key, CAFile: o.tls.ca,
		Logf: func(format string, args ...any) {
			// What the server cannot go on without (natsembed's logger prefixes it) is
			// the daemon's error; the rest is the server's chatter.
			if strings.HasPrefix(format, "nats fatal: ") {
				log.Error("nats", "msg", fmt.Sprintf(format, args...))
				return
			}
			log.Debug("nats", "msg", fmt.Sprintf(format, args...))
		}})
	if err != nil {
		return nil, err
	}
	return s, nil
}
