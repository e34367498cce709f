package engine

import (
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"time"

	"github.com/forkvm/forkvm/vsockd"
)

// AgentTarget is what is needed to reach a VM's agent without an engine (so that a
// long interactive exec does not hold the state directory lock).
type AgentTarget struct {
	Name string `json:"name"`
	// Socket is the agent's virtio-serial chardev socket (used when CID is 0).
	Socket string `json:"socket"`
	// CID is the guest's AF_VSOCK context id; non-zero means dial vsock.
	CID   uint32 `json:"cid,omitempty"`
	Token string `json:"token"`
}

// hello is the handshake that makes a VM ready: the VM's own token (a fork answers only
// to its own, so a fork cannot be mistaken for its parent or a sibling), fresh host
// entropy for the guest CRNG (a fork starts with its parent's RNG state), the host clock
// (a fork's clock is its checkpoint's) and the hostname.
func (t AgentTarget) hello() (vsockd.Hello, error) {
	tok, err := parseToken(t.Token)
	if err != nil {
		return vsockd.Hello{}, err
	}
	ent := make([]byte, 32)
	_, _ = rand.Read(ent)
	return vsockd.Hello{Token: tok, Entropy: ent, Time: time.Now(), Hostname: t.Name}, nil
}

// DialAgent connects to an agent and performs the handshake (see AgentTarget.hello). It
// fails with ErrAgentTimeout wrapped when ctx ends first.
func DialAgent(ctx context.Context, t AgentTarget) (*vsockd.Client, error) {
	if _, err := parseToken(t.Token); err != nil {
		return nil, err
	}
	conn, err := dialTarget(ctx, t)
	if err != nil {
		return nil, agentErr(ctx, t.Name, err)
	}
	c := vsockd.NewClient(conn, nil)
	if err := sayHello(ctx, c, t); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// sayHello runs the handshake on an open agent connection.
func sayHello(ctx context.Context, c *vsockd.Client, t AgentTarget) error {
	h, err := t.hello()
	if err != nil {
		return err
	}
	if _, err := c.Hello(ctx, h); err != nil {
		return agentErr(ctx, t.Name, err)
	}
	return nil
}

// agentErr wraps an agent failure, as ErrAgentTimeout when ctx ended.
func agentErr(ctx context.Context, name string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w: %s: %w", ErrAgentTimeout, name, err)
	}
	return fmt.Errorf("engine: agent %s: %w", name, err)
}

// dialTarget connects to an agent over vsock (retrying while the guest's listener is not
// up yet) or its virtio-serial socket.
func dialTarget(ctx context.Context, t AgentTarget) (net.Conn, error) {
	if t.CID == 0 {
		return vsockd.DialUnix(ctx, t.Socket)
	}
	for {
		conn, err := vsockd.DialVsock(ctx, t.CID, vsockd.DefaultVsockPort)
		if err == nil {
			return conn, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// clientDone reports whether an agent connection has ended.
func clientDone(c *vsockd.Client) bool {
	select {
	case <-c.Done():
		return true
	default:
		return false
	}
}
