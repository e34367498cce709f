// Package fleet spreads fork waves over many forkvm daemons (nodes) through NATS
// JetStream: one job per fork on a work-queue stream per compatibility class, pulled
// by every node while its admission budget allows; placement and state in JetStream
// key-value buckets, which are the truth (node heartbeats with a TTL, fork claims made
// with Create and fenced by revision, checkpoints by digest with the nodes holding
// them, one record per job). Checkpoint bytes never go through NATS: a node that lacks
// a checkpoint has a CheckpointFetcher copy it from a node that holds it.
//
// A node that dies mid-wave loses its unfinished jobs to the others (redelivered after
// the ack wait) and its ready forks are reported lost; a daemon that only restarted
// within the heartbeat TTL keeps its VMs. Local forks never go through this package.
package fleet

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/forkvm/forkvm/api"
)

// Errors of the fleet, wrapped with %w.
var (
	// ErrConfig reports a configuration refused before anything starts.
	ErrConfig = errors.New("fleet: bad configuration")
	// ErrUnavailable reports NATS not answering within a call's retries.
	ErrUnavailable = errors.New("fleet: NATS unavailable")
	// ErrNoNode reports a wave no live node can run (none of the checkpoint's class).
	ErrNoNode = errors.New("fleet: no live node of the checkpoint's class")
	// ErrNodeLost reports a fork whose node's heartbeat expired after it was ready.
	ErrNodeLost = errors.New("fleet: node lost")
	// ErrDeadLetter reports a job no node completed within its delivery limit.
	ErrDeadLetter = errors.New("fleet: job exhausted its deliveries")
	// ErrNoRoom reports a fork no live node had room for: none of the class's budgets
	// can ever hold one fork of its size, or none showed room for Config.RoomWait. It
	// wraps an *api.AdmissionError (code admission) naming the largest budget seen.
	ErrNoRoom = errors.New("fleet: no live node has room for the fork")
	// ErrClosed reports use of a fleet that left.
	ErrClosed = errors.New("fleet: closed")
)

// Defaults of Config's timing.
const (
	DefaultHeartbeat  = time.Second
	DefaultTTL        = 6 * time.Second
	DefaultAckWait    = 10 * time.Second
	DefaultMaxDeliver = 10
	DefaultRoomWait   = 10 * time.Second
	// backstopDeliveries is the consumer's own delivery limit, in MaxDeliver units: a
	// job's failures are counted in its record (give-backs for want of room are not
	// failures), so the server's count, which every redelivery raises, only ends a job
	// that loops for another reason.
	backstopDeliveries = 20
	// callTimeout bounds one JetStream call; calls are retried (callRetries) with a
	// backoff, so that a stream or consumer without a leader for a few seconds (an
	// election after a node died takes seconds) delays a call instead of hanging it.
	callTimeout = 2 * time.Second
	callRetries = 6
	// electionWait is how long a call keeps retrying failures however fast they come:
	// during an election, requests fail at once ("no responders"), so six quick tries
	// can all end before the election does, losing records of forks that were made.
	electionWait = 10 * time.Second
)

// Bucket and stream names.
const (
	bucketNodes  = "forkvm_nodes"
	bucketClaims = "forkvm_claims"
	bucketJobs   = "forkvm_jobs"
	bucketCks    = "forkvm_checkpoints"
	consumerName = "workers"
)

// Node is a peer as a CheckpointFetcher needs it: its name and its daemon's API.
type Node struct {
	Name string
	// Addr is the node's daemon API (http://host:port).
	Addr string
}

// CheckpointFetcher copies a checkpoint from another node into the local engine: after
// Fetch returns without an error the engine has checkpoint ck, with the same digest
// (its files verified against the holder's digests), and the result says what was
// fetched. A file that arrives other than its holder recorded it is refused with
// api.ErrDigest, keeping nothing: the job then fails (with code digest_mismatch)
// unless another holder's copy is good.
type CheckpointFetcher interface {
	Fetch(ctx context.Context, ck string, from Node) (*api.PullResult, error)
}

// Config is a node's membership.
type Config struct {
	// Node is this node's name in the fleet (default: the host name).
	Node   string
	Labels map[string]string
	// Addr is this daemon's API that other nodes pull checkpoints from (empty: none).
	Addr string
	// Connect opens the connection to NATS (an external cluster's URLs with
	// credentials, or the embedded server in process). Required.
	Connect func() (*nats.Conn, error)
	// Replicas of every stream and bucket (default 1; 3 in a fleet of 3 or more).
	Replicas int
	// Heartbeat is the interval of the node's heartbeat, TTL how long after its last
	// one a node counts as gone.
	Heartbeat, TTL time.Duration
	// AckWait is how long a job may go without an in-progress notice before it is
	// redelivered; MaxDeliver how many failed tries a job gets before it is dead (a node
	// that gives a job back for want of room does not count).
	AckWait    time.Duration
	MaxDeliver int
	// RoomWait is how long a wave this node receives lets its forks wait while no live
	// node of the class shows room for one (its free vCPUs in its heartbeat) before it
	// fails those not yet taken with ErrNoRoom (default 10 s).
	RoomWait time.Duration
	// MaxVCPUs, when > 0, caps the vCPUs of this node's VMs that fleet jobs may take
	// (below the engine's own admission budget, which always applies).
	MaxVCPUs int
	// MaxJobs bounds the jobs this node forks at once. Default: twice the host's CPUs
	// as its engine's budget reports them (the engine restores that many forks at once
	// by default, and a job taken starts its fork's QEMU at once: a node that took more
	// would keep jobs from nodes with room, and start forks in a burst beside its NATS
	// server), or 8 when it reports none.
	MaxJobs int
	// Dir holds the node's own records (the forks it made for the fleet); empty: none kept,
	// and no orphan is ever deleted.
	Dir    string
	Logger *slog.Logger
}

// Fleet is one node's membership: it heartbeats, pulls jobs and runs waves.
type Fleet struct {
	cfg   Config
	log   *slog.Logger
	eng   Engine
	fetch CheckpointFetcher
	nc    *nats.Conn
	js    jetstream.JetStream

	nodes, claims, jobs, cks jetstream.KeyValue
	// protect holds the protection records (protect.go).
	protect jetstream.KeyValue

	class   api.FleetClass
	classID string
	boot    string
	started time.Time
	// beatingSince is when this node's heartbeat writes last began to succeed without
	// a failure in between (UnixNano; 0 while they fail): see expired.
	beatingSince atomic.Int64
	// lastBeat is when this node's last prompt heartbeat write ended (UnixNano), and
	// lastBeatStamp the time that heartbeat carries (taken before the write: the time
	// other nodes judge it by), which fencing counts from.
	lastBeat      atomic.Int64
	lastBeatStamp atomic.Int64
	// lastWritten is the time this node's last written heartbeat carries, prompt or
	// not (UnixNano): the worker takes jobs only while it is recent (seen).
	lastWritten atomic.Int64
	// silenced stops this node's heartbeats (tests: a node that dies right after a
	// fork's record, before it beats again, now that a job's end beats at once).
	silenced atomic.Bool
	// beatsFail makes every heartbeat fail as a write to a bucket without a leader does
	// (tests: an election, or a node cut off from NATS).
	beatsFail atomic.Bool
	// viewStalled makes the watch of the nodes drop what it hears (tests: a watch whose
	// consumer went with a stream leader that died, silent until it is made again).
	viewStalled atomic.Bool
	// recsStalled makes each read of the protection records started while it is set
	// wait for its deadline unanswered (tests: a read asked of a stream leader that
	// died).
	recsStalled atomic.Bool
	// recsStarted counts the reads of the protection records started (tests).
	recsStarted atomic.Int64
	// listsStalled and readsStalled are how many of eachLatest's next requests for a
	// stream's keys, and for one key's value, go unanswered (tests: a request asked of
	// a stream leader that died).
	listsStalled, readsStalled atomic.Int64

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu sync.Mutex
	// running counts the jobs being handled; runningCPUs the vCPUs of those not yet
	// handed to the engine (reserved before it admits them); forking the vCPUs of
	// those handed to it, by fork name, until the job ends (the engine counts a fork
	// from its admission, but lists it only once it is ready).
	running, runningCPUs int
	runningMem           int64 // the memory of those not yet handed, as runningCPUs
	// shown counts the jobs the heartbeat reports (api.FleetNode.Running): running, less
	// those whose outcome is recorded and that only ack now (settle).
	shown   int
	forking map[string]int
	// perWave counts, per wave, the forks this node took (for MaxPerNode and a spread
	// wave's share): by name, with the tries of each under way or made, so that a job
	// redelivered to this node while its first try runs (or a replacement of a fork it
	// made) is one fork of its share, not two.
	perWave map[string]waveForks
	// waveSeen is when this node last took a job of each wave in perWave: a wave
	// not seen for waveForget can send no more jobs (they expire from the stream after
	// jobMaxAge), and its entry goes (pruneWaves).
	waveSeen map[string]time.Time
	// trying holds the ids of the jobs this node has a try of under way: a job
	// delivered again meanwhile (its in-progress notices lost for an ack wait) is that
	// try's (take).
	trying map[string]bool
	// fetching holds a lock per checkpoint digest being fetched.
	fetching map[string]*fetchLock
	// slot is signalled when a job ends.
	slot chan struct{}
	// beatNow asks the heartbeat loop for a heartbeat at once (a job ended).
	beatNow chan struct{}
	// closed is set by Close: no background work starts after it.
	closed bool
	// fenced names the protected VMs this node fenced (protect.go), until settled;
	// ownerLost since when each owner of a record this node holds counts as lost (the
	// earliest of its last heartbeat seen and a TTL, the leader's expiry marker, and
	// when this node first found it lost: settle);
	// reviving the VMs of lost owners this node is taking over (settle); expiredSeen
	// when the leader marked an owner's heartbeat expired, as noted before this node
	// judged (noteExpiries).
	fenced      map[string]bool
	ownerLost   map[string]time.Time
	reviving    map[string]bool
	expiredSeen map[string]expiryNote
	// leaseMu serializes the lease's renewals (fence.go): the heartbeat loop renews it
	// with each prompt beat, the protection loop after a freeze and before a thaw, and
	// both write the same temporary file and start the watchdog when none runs.
	leaseMu sync.Mutex
	// watchdog is closed when the fence watchdog this node started has exited (nil:
	// none started; fence.go). Under leaseMu.
	watchdog <-chan struct{}

	// cacheMu guards the caches: the live nodes a share check saw last (nodesAt), the
	// nodes bucket as this node's watch of it has it (view, viewAt: the last update,
	// zero while the watch is down), and the checkpoint holder entries this node wrote.
	cacheMu    sync.Mutex
	nodesCache []api.FleetNode
	nodesAt    time.Time
	view       map[string]api.FleetNode
	viewAt     time.Time
	// gone is, for each node whose heartbeat key this watch saw expire (or deleted),
	// the stamp of its last heartbeat the watch saw before: the watch delivers the
	// bucket in order, so it is the node's last. Cleared when a watch is made again.
	gone map[string]time.Time
	held map[string]bool
}

// ClassID is the id of a compatibility class: a short digest of its fields.
func ClassID(c api.FleetClass) string {
	h := sha256.Sum256([]byte(c.QEMU + "\x00" + c.Accel + "\x00" + c.Arch))
	return "c" + hex.EncodeToString(h[:6])
}

// HostArch is the architecture part of this host's classes.
func HostArch() string { return runtime.GOARCH }

// Join connects the node to the fleet, makes the buckets and its class's stream when
// missing, deletes the forks it holds whose claims another node took while it was
// gone, releases its claims of forks it no longer holds, and starts its heartbeat and
// job loop. Close leaves.
func Join(ctx context.Context, cfg Config, eng Engine, fetch CheckpointFetcher) (*Fleet, error) {
	if cfg.Connect == nil {
		return nil, fmt.Errorf("%w: no NATS connection", ErrConfig)
	}
	if cfg.Node == "" {
		return nil, fmt.Errorf("%w: no node name", ErrConfig)
	}
	if err := checkToken(cfg.Node); err != nil {
		return nil, fmt.Errorf("%w: node name: %v", ErrConfig, err)
	}
	if cfg.Replicas <= 0 {
		cfg.Replicas = 1
	}
	if cfg.Heartbeat <= 0 {
		cfg.Heartbeat = DefaultHeartbeat
	}
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultTTL
	}
	if cfg.TTL < 2*cfg.Heartbeat {
		return nil, fmt.Errorf("%w: TTL %v under two heartbeats of %v", ErrConfig, cfg.TTL, cfg.Heartbeat)
	}
	if cfg.AckWait <= 0 {
		cfg.AckWait = DefaultAckWait
	}
	if cfg.MaxDeliver <= 0 {
		cfg.MaxDeliver = DefaultMaxDeliver
	}
	if cfg.MaxJobs <= 0 {
		cfg.MaxJobs = 8
		if n := eng.Budget().HostCPUs; n > 0 {
			cfg.MaxJobs = 2 * n
		}
	}
	if cfg.RoomWait <= 0 {
		cfg.RoomWait = DefaultRoomWait
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	class, err := eng.Class(ctx)
	if err != nil {
		return nil, err
	}
	nc, err := cfg.Connect()
	if err != nil {
		return nil, fmt.Errorf("%w: connect: %w", ErrUnavailable, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	f := &Fleet{cfg: cfg, log: log, eng: eng, fetch: fetch, nc: nc, js: js, class: class, classID: ClassID(class),
		boot: randHex(8), started: time.Now().UTC(), perWave: map[string]waveForks{}, waveSeen: map[string]time.Time{}, trying: map[string]bool{}, forking: map[string]int{}, slot: make(chan struct{}, 1), beatNow: make(chan struct{}, 1)}
	f.ctx, f.cancel = context.WithCancel(context.Background())
	fail := func(err error) (*Fleet, error) {
		f.cancel()
		f.wg.Wait()
		nc.Close()
		return nil, err
	}
	// The heartbeat first: a daemon that restarts is the same live node to the others
	// once it beats again within the TTL, and the rest of the set-up may wait seconds
	// for the streams it led to elect new leaders.
	if err := f.setupNodes(ctx); err != nil {
		return fail(err)
	}
	if err := retry(ctx, "first heartbeat", f.beat); err != nil {
		return fail(err)
	}
	log.Info("fleet: first heartbeat written", "node", cfg.Node, "boot", f.boot, "after", time.Since(f.started).Round(time.Millisecond))
	f.wg.Add(1)
	go f.heartbeatLoop()
	if err := f.setup(ctx); err != nil {
		return fail(err)
	}
	if err := f.deleteOrphans(ctx); err != nil {
		log.Warn("fleet: orphans not checked", "err", err)
	}
	if err := f.serveRemovals(); err != nil {
		return fail(fmt.Errorf("%w: subscribe: %w", ErrUnavailable, err))
	}
	if err := f.serveProtection(); err != nil {
		return fail(fmt.Errorf("%w: subscribe: %w", ErrUnavailable, err))
	}
	f.wg.Add(3)
	go f.watchNodes()
	go f.workLoop()
	go f.protectionLoop()
	return f, nil
}

// Close stops pulling jobs, cancels the jobs running (they go to other nodes), waits
// for them (up to ctx) and disconnects. The heartbeat is left to expire: a daemon that
// restarts within the TTL is the same node to the others, its VMs kept and claimed.
func (f *Fleet) Close(ctx context.Context) error {
	f.mu.Lock()
	f.closed = true
	f.mu.Unlock()
	f.cancel()
	done := make(chan struct{})
	go func() { f.wg.Wait(); close(done) }()
	var err error
	select {
	case <-done:
	case <-ctx.Done():
		err = ctx.Err()
	}
	f.nc.Close()
	f.leaveLease()
	return err
}

// Name is this node's name.
func (f *Fleet) Name() string { return f.cfg.Node }

// Class is this node's compatibility class.
func (f *Fleet) Class() api.FleetClass { return f.class }

// nodesBucket is the heartbeat bucket's configuration.
func (f *Fleet) nodesBucket() jetstream.KeyValueConfig {
	return jetstream.KeyValueConfig{Bucket: bucketNodes, History: 1, TTL: f.cfg.TTL, LimitMarkerTTL: f.cfg.TTL, Replicas: f.cfg.Replicas, Storage: jetstream.MemoryStorage}
}

// setupNodes binds the heartbeat bucket, or makes it when there is none, retried (a
// replicated bucket made right after the cluster formed may find too few peers). A
// bucket that exists is bound by a look-up its stream's leader answers: making or
// updating one needs the cluster's meta leader, which a restarting daemon may have
// taken down with it (setup updates it later).
func (f *Fleet) setupNodes(ctx context.Context) error {
	cfg := f.nodesBucket()
	return retry(ctx, "bucket "+cfg.Bucket, func(ctx context.Context) error {
		kv, err := f.js.KeyValue(ctx, cfg.Bucket)
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			kv, err = f.js.CreateOrUpdateKeyValue(ctx, cfg)
		}
		if err == nil {
			f.nodes = kv
		}
		return err
	})
}

// setup makes or updates the buckets and this node's class stream and consumer, each
// retried as setupNodes.
func (f *Fleet) setup(ctx context.Context) error {
	r := f.cfg.Replicas
	buckets := []struct {
		kv  *jetstream.KeyValue
		cfg jetstream.KeyValueConfig
	}{
		{nil, f.nodesBucket()}, // bound already (the heartbeats use it): updated only
		{&f.claims, jetstream.KeyValueConfig{Bucket: bucketClaims, History: 1, Replicas: r, Storage: jetstream.FileStorage}},
		{&f.jobs, jetstream.KeyValueConfig{Bucket: bucketJobs, History: 1, TTL: 24 * time.Hour, Replicas: r, Storage: jetstream.FileStorage}},
		{&f.cks, jetstream.KeyValueConfig{Bucket: bucketCks, History: 1, Replicas: r, Storage: jetstream.FileStorage}},
		{&f.protect, f.protectBucket()},
	}
	for _, b := range buckets {
		err := retry(ctx, "bucket "+b.cfg.Bucket, func(ctx context.Context) error {
			kv, err := f.js.CreateOrUpdateKeyValue(ctx, b.cfg)
			if err == nil && b.kv != nil {
				*b.kv = kv
			}
			return err
		})
		if err != nil {
			return err
		}
	}
	return f.ensureStream(ctx, f.classID)
}

// streamName is the work-queue stream of a class.
func streamName(classID string) string { return "FORKVM_JOBS_" + classID }

// subject is the subject of a class's jobs.
func subject(classID string) string { return "forkvm.jobs." + classID }

// jobMaxAge is how long a job stays in its class's stream, taken or not.
const jobMaxAge = time.Hour

// waveForget is how long after this node last took a job of a wave it forgets its
// forks of that wave: past jobMaxAge no job of it can come any more.
const waveForget = 2 * jobMaxAge

// ensureStream makes a class's work-queue stream and its one shared durable consumer
// (a second consumer overlapping a work-queue stream is refused).
func (f *Fleet) ensureStream(ctx context.Context, classID string) error {
	err := retry(ctx, "stream "+classID, func(ctx context.Context) error {
		_, err := f.js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
			Name: streamName(classID), Subjects: []string{subject(classID)},
			Retention: jetstream.WorkQueuePolicy, Storage: jetstream.FileStorage, Replicas: f.cfg.Replicas,
			Duplicates: 10 * time.Minute, MaxAge: jobMaxAge,
		})
		return err
	})
	if err != nil {
		return err
	}
	return retry(ctx, "consumer "+classID, func(ctx context.Context) error {
		_, err := f.js.CreateOrUpdateConsumer(ctx, streamName(classID), jetstream.ConsumerConfig{
			Durable: consumerName, AckPolicy: jetstream.AckExplicitPolicy, AckWait: f.cfg.AckWait,
			MaxDeliver: backstopDeliveries * f.cfg.MaxDeliver, MaxAckPending: 100000, Replicas: f.cfg.Replicas,
		})
		return err
	})
}

// retry runs fn with its own short timeout until it succeeds, fails for good or the
// retries are spent, callRetries of them and, unless the connection is closed, at
// least electionWait (then ErrUnavailable). ctx bounds it all.
func retry(ctx context.Context, what string, fn func(ctx context.Context) error) error {
	return retryEach(ctx, what, callTimeout, fn)
}

// listTimeout bounds one try of a listing read from a stream's leader (eachLatest):
// one request per key, each bounded by callTimeout.
const listTimeout = 10 * callTimeout

// retryEach is retry with each try bounded by timeout.
func retryEach(ctx context.Context, what string, timeout time.Duration, fn func(ctx context.Context) error) error {
	var err error
	backoff := 100 * time.Millisecond
	start := time.Now()
	for attempt := 0; attempt < callRetries || (time.Since(start) < electionWait && !errors.Is(err, nats.ErrConnectionClosed)); attempt++ {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		err = fn(cctx)
		cancel()
		if err == nil || final(err) {
			return err
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%s: %w", what, ctx.Err())
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: %w", what, ctx.Err())
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
	return fmt.Errorf("%w: %s: %w", ErrUnavailable, what, err)
}

// final says whether a JetStream error is an answer (retrying cannot change it)
// rather than a failure to get one.
func final(err error) bool {
	if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyNotFound) ||
		errors.Is(err, jetstream.ErrKeyDeleted) || errors.Is(err, jetstream.ErrMsgNotFound) ||
		errors.Is(err, jetstream.ErrInvalidKey) {
		return true
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		switch apiErr.ErrorCode {
		case jetstream.JSErrCodeStreamWrongLastSequence, jetstream.JSErrCodeMessageNotFound:
			return true
		}
		// 10071: wrong last sequence on a KV update (the fence).
		if apiErr.ErrorCode == 10071 {
			return true
		}
	}
	return false
}

// CheckNodeName says whether name can be a node's name: letters, digits, - and _,
// at most 128 bytes.
func CheckNodeName(name string) error {
	if err := checkToken(name); err != nil {
		return fmt.Errorf("%w: node name: %v", api.ErrInvalidSpec, err)
	}
	return nil
}

// checkToken refuses a string that cannot be a token of a subject or key.
func checkToken(s string) error {
	if s == "" || len(s) > 128 {
		return errors.New("empty or over 128 bytes")
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return fmt.Errorf("%q: only letters, digits, - and _", s)
		}
	}
	return nil
}

// kvKey escapes a VM or checkpoint name into one key token ('.' is the separator of
// key tokens): letters, digits, - and _ stay, anything else becomes =XX.
func kvKey(name string) string {
	var b strings.Builder
	for i := 0; i < len(name); i++ {
		c := name[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "=%02X", c)
		}
	}
	return b.String()
}

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// getJSON reads a key into v; ok is false when the key is absent (or deleted).
func getJSON(ctx context.Context, kv jetstream.KeyValue, key string, v any) (rev uint64, ok bool, err error) {
	var e jetstream.KeyValueEntry
	err = retry(ctx, "get "+key, func(ctx context.Context) error {
		var err error
		e, err = kv.Get(ctx, key)
		return err
	})
	if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	if err := json.Unmarshal(e.Value(), v); err != nil {
		return 0, false, fmt.Errorf("fleet: key %s: %w", key, err)
	}
	return e.Revision(), true, nil
}

// putJSON writes v under key.
func putJSON(ctx context.Context, kv jetstream.KeyValue, key string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return retry(ctx, "put "+key, func(ctx context.Context) error {
		_, err := kv.Put(ctx, key, b)
		return err
	})
}
