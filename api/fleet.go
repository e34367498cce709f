package api

import (
	"fmt"
	"time"
)

// Schema names of the fleet's objects.
const (
	NodeSchema    = "forkvm.node/v1"
	FleetVMSchema = "forkvm.fleet-vm/v1"
)

// Codes of a fleet wave's failures (ForkEventObject.Code) that have no sentinel of
// this package: the fleet's own (package fleet has the errors).
const (
	// CodeNodeLost: the fork was ready on a node whose heartbeat then expired.
	CodeNodeLost = "node_lost"
	// CodeDeadLetter: no node completed the fork's job within its delivery limit.
	CodeDeadLetter = "dead_letter"
	// CodeNoFleet: the daemon is not part of a fleet (it was started without --cluster).
	CodeNoFleet = "no_fleet"
	// CodeFleetUnavailable: the daemon's fleet cannot answer now (JetStream without a
	// leader, or the daemon still joining it): try again shortly.
	CodeFleetUnavailable = "fleet_unavailable"
	// CodeNoNode: no live node can fork the checkpoint (none of its compatibility class).
	CodeNoNode = "no_node"
)

// FleetClass is a node's compatibility class: a checkpoint forks only on nodes of the
// class it was taken in (the same QEMU, accelerator and host architecture; the machine
// type and guest kernel travel with the checkpoint).
type FleetClass struct {
	QEMU  string `json:"qemu"`
	Accel string `json:"accel"`
	Arch  string `json:"arch"`
}

// FleetNode is a node of the fleet as its last heartbeat describes it (forkvm.node/v1).
type FleetNode struct {
	Schema string `json:"schema,omitempty"`
	Name   string `json:"name"`
	// Addr is the node's daemon API for checkpoint pulls (empty: it serves none).
	Addr   string            `json:"addr,omitempty"`
	Labels map[string]string `json:"labels,omitempty"`
	// Class is the compatibility class's id; ClassInfo what it stands for.
	Class     string     `json:"class"`
	ClassInfo FleetClass `json:"class_info"`
	// Boot changes with every start of the node's daemon.
	Boot string `json:"boot"`
	// TotalVCPUs and FreeVCPUs are the node's fleet budget (its admission budget, or
	// less when the node was given a cap); Memory the engine's memory budget, less the
	// fleet jobs the node took and has not handed to its engine yet, and
	// FreeMemoryBytes its FreeBytes. A node has room for a fork of c vCPUs and a guest
	// of G bytes when FreeVCPUs >= c and Memory.Fits(G).
	TotalVCPUs      int          `json:"total_vcpus"`
	FreeVCPUs       int          `json:"free_vcpus"`
	FreeMemoryBytes int64        `json:"free_memory_bytes"`
	Memory          MemoryBudget `json:"memory"`
	// VMs counts the node's live VMs; Running the fleet jobs it is forking now.
	VMs       int       `json:"vms"`
	Running   int       `json:"running_jobs"`
	Heartbeat time.Time `json:"heartbeat"`
	StartedAt time.Time `json:"started_at"`
}

// FleetCheckpointRemoval is what one node did with its copy of a checkpoint removed
// from the fleet (DELETE /v1/fleet/checkpoints/NAME): outcome "removed", "none" (it had
// no copy of that content), "in_use" (forks use it: it goes with its last fork),
// "pinned" (its user's, kept) or "failed" (Error and Code say why).
type FleetCheckpointRemoval struct {
	Node    string `json:"node"`
	Outcome string `json:"outcome"`
	Error   string `json:"error,omitempty"`
	Code    string `json:"code,omitempty"`
}

// FleetVMDeleted answers DELETE /v1/fleet/vms/NAME: the node that held the fork.
type FleetVMDeleted struct {
	Name string `json:"name"`
	Node string `json:"node"`
}

// FleetVM is a fleet fork as its claim records it (forkvm.fleet-vm/v1): the claim, in
// the fleet's key-value store, is the truth of which node holds which name.
type FleetVM struct {
	Schema     string `json:"schema,omitempty"`
	Name       string `json:"name"`
	Node       string `json:"node"`
	Checkpoint string `json:"checkpoint"`
	Wave       string `json:"wave"`
	Index      int    `json:"index"`
	// State is "forking" or "ready", or "node_lost" when the holding node's heartbeat
	// has expired.
	State     string    `json:"state"`
	CPUs      int       `json:"cpus"`
	ClaimedAt time.Time `json:"claimed_at"`
	// Protection is the fleet's record of a protected VM (docs/protect.md): a protected
	// VM that no wave made is listed by it alone (Node its owner, State "protected").
	Protection *FleetProtection `json:"protection,omitempty"`
}

// FleetProtection is a protected VM as the fleet records it.
type FleetProtection struct {
	Every time.Duration `json:"every_ns"`
	// Point is its last complete protection point, PointAt when its guest stopped (the
	// work a revival loses is what the VM did since), Copies the nodes holding it.
	Point   string    `json:"point"`
	PointAt time.Time `json:"point_at"`
	Copies  []string  `json:"copies"`
	// RevivedFrom is the node it was revived from at its last fail-over, RevivedAt
	// when, and LostWork and LostWorkMax bound the guest time since its point that the
	// revival lost: at least up to its node's last heartbeat (a node killed then), at
	// most up to a TTL later, when a node that was cut off, not dead, froze it.
	RevivedFrom string        `json:"revived_from,omitempty"`
	RevivedAt   time.Time     `json:"revived_at,omitzero"`
	LostWork    time.Duration `json:"lost_work_ns,omitempty"`
	LostWorkMax time.Duration `json:"lost_work_max_ns,omitempty"`
	// Error is why its last revival failed ("" when none did).
	Error string `json:"error,omitempty"`
}

// FleetForkRequest is the body of POST /v1/fleet/forks: a wave spread over the fleet.
// Source must be a checkpoint of the receiving daemon.
type FleetForkRequest struct {
	ForkRequest
	// Pack lets each node take as many forks as its budget allows; the default
	// (spread) gives no node more than ceil(n / live nodes of the class).
	Pack bool `json:"pack,omitempty"`
	// MaxPerNode, when > 0, caps the forks of this wave on any one node.
	MaxPerNode int `json:"max_per_node,omitempty"`
	// ReplaceLost forks again, on another node, every fork reported node_lost while the
	// wave runs. Such a wave ends only once each ready fork's node has beaten after the
	// fork was ready (or was lost): up to a heartbeat interval after the last fork.
	ReplaceLost bool `json:"replace_lost,omitempty"`
	// Protect, when > 0, protects each fork on its node once it is ready, a point every
	// Protect (ProtectOptions.Every; docs/protect.md).
	Protect time.Duration `json:"protect_ns,omitempty"`
}

// Validate checks a fleet wave before it is published, with the fork request's rules
// (ForkRequest.Validate, n up to MaxFleetForks) and the fleet's own: a wave publishes
// no ports (a fork's node, and so its host, is not known in advance), forks a
// checkpoint (Pin is for the implicit checkpoint of a running VM), runs as the nodes
// pull it (no Concurrency), and MaxPerNode is not negative. Each error wraps
// ErrInvalidSpec or ErrInvalidName.
func (r FleetForkRequest) Validate() error {
	switch {
	case len(r.Publish) > 0:
		return fmt.Errorf("%w: a fleet wave publishes no ports (a fork's node is not known in advance)", ErrInvalidSpec)
	case r.Pin:
		return fmt.Errorf("%w: a fleet wave forks a checkpoint, not a running VM (pin has no use)", ErrInvalidSpec)
	case r.Concurrency != 0:
		return fmt.Errorf("%w: a fleet wave's forks start as nodes take them (concurrency has no use)", ErrInvalidSpec)
	case r.MaxPerNode < 0:
		return fmt.Errorf("%w: max_per_node %d", ErrInvalidSpec, r.MaxPerNode)
	case r.Protect != 0:
		o := ProtectOptions{Every: r.Protect}
		if err := o.Normalize(); err != nil {
			return err
		}
	}
	return r.ForkRequest.validate(MaxFleetForks)
}

// FleetForkEventObject is one line of a fleet wave's stream: the fork event of a
// local wave (forkvm.fork-event/v1) with the node that made the fork and the job's
// attempt (1, then 2… for a fork replaced after its node was lost). A fork reported
// ready may be reported again, failed with code node_lost.
type FleetForkEventObject struct {
	ForkEventObject
	Node    string `json:"node,omitempty"`
	Attempt int    `json:"attempt,omitempty"`
	// RecordedAt is when the node recorded the fork's end, by the node's clock (the
	// clock of its heartbeats); zero when another node recorded it.
	RecordedAt time.Time `json:"recorded_at,omitzero"`
	FleetTiming
}

// FleetTiming is the fleet's time on one fork beside the fork itself (its LatencyMS),
// in milliseconds, as the node that made it measured it: what a fleet wave costs over a
// local one. Events of forks no node made (failed by the wave, node_lost) carry none.
type FleetTiming struct {
	// QueueMS runs from the wave's publish of the job to a node taking it, with any wait
	// for a node with room; DispatchMS is its part after that node asked for jobs.
	QueueMS    float64 `json:"queue_ms,omitempty"`
	DispatchMS float64 `json:"dispatch_ms,omitempty"`
	// ClaimMS is the claim of the fork's name. At a job's first delivery the name is
	// claimed while the node pulls and forks, so that only what it takes beyond them
	// is in FleetMS.
	ClaimMS float64 `json:"claim_ms,omitempty"`
	// PullMS is the node's pull of the checkpoint from another node, or its wait for
	// its own pull of it (0 when the node had it).
	PullMS float64 `json:"pull_ms,omitempty"`
	// FleetMS is the node's time on the job besides the fork and the pull: its record
	// read (none at a job's first delivery) and writes (the start record is written
	// while the node pulls and forks), the claim (ClaimMS), its share check and the
	// ready fence.
	FleetMS float64 `json:"fleet_ms,omitempty"`
}

// HasRoom reports whether the node's heartbeat shows room for one fork of cpus vCPUs
// and a guest of guest bytes.
func (n FleetNode) HasRoom(cpus int, guest int64) bool {
	return n.FreeVCPUs >= cpus && n.Memory.Fits(guest)
}
