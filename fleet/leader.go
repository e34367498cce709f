package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"
)

// Reads a judgement rests on go to the bucket's stream leader. A listing through a
// watch is an R1 ordered consumer, which the cluster places on any replica of the
// stream, and a direct get may be answered by any replica at least 90% caught up; a
// node that just restarted serves what it held when it died until it has caught up.
// Right after a node restarted, a listing of the claims once showed them as they were
// before a takeover, and one of the heartbeats showed no live node at all (the wave
// was refused). The leader answers a stream's subjects and each subject's last
// message with everything the stream has committed.

// leaderGets bounds the last-message reads one listing has in flight.
const leaderGets = 16

// leaderEntry is one key of a bucket as its stream's leader has it.
type leaderEntry struct {
	key   string
	rev   uint64
	value []byte
	// expiredAt is when the stream's leader marked the key expired (a MaxAge marker),
	// for an entry read as none: its last value was then at least the bucket's TTL old.
	expiredAt time.Time
}

// eachLatest calls fn with every live entry of kv (deleted, purged and expired keys
// left out), as the stream's leader has them; fn is called from one goroutine at a
// time. Each of its requests is bounded by callTimeout and retried alone (retry): one
// asked of a leader that died goes unanswered, and it held the whole listing until the
// caller's deadline, a TTL or more.
func (f *Fleet) eachLatest(ctx context.Context, kv jetstream.KeyValue, fn func(leaderEntry)) error {
	stream, prefix := kvStream(kv)
	var info *jetstream.StreamInfo
	err := retry(ctx, "list "+kv.Bucket(), func(ctx context.Context) error {
		if err := stalledCall(ctx, &f.listsStalled); err != nil {
			return err
		}
		s, err := f.js.Stream(ctx, stream)
		if err != nil {
			return err
		}
		info, err = s.Info(ctx, jetstream.WithSubjectFilter(prefix+">"))
		return err
	})
	if err != nil {
		return err
	}
	var mu sync.Mutex
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(leaderGets)
	for subj := range info.State.Subjects {
		g.Go(func() error {
			var e leaderEntry
			var ok bool
			err := retry(gctx, "read "+subj, func(ctx context.Context) (err error) {
				if err := stalledCall(ctx, &f.readsStalled); err != nil {
					return err
				}
				e, ok, err = f.leaderLast(ctx, stream, subj)
				return err
			})
			if err != nil || !ok {
				return err
			}
			e.key = strings.TrimPrefix(subj, prefix)
			mu.Lock()
			defer mu.Unlock()
			fn(e)
			return nil
		})
	}
	return g.Wait()
}

// stalledCall is where a test makes one of eachLatest's requests go unanswered while
// *count is above zero (listsStalled, readsStalled): it takes one off and waits for the
// try's deadline.
func stalledCall(ctx context.Context, count *atomic.Int64) error {
	for {
		n := count.Load()
		if n <= 0 {
			return nil
		}
		if count.CompareAndSwap(n, n-1) {
			<-ctx.Done()
			return ctx.Err()
		}
	}
}

// leaderGet reads key's value in kv from the stream's leader; ok is false when the key
// has none (never written, deleted, purged or expired).
func (f *Fleet) leaderGet(ctx context.Context, kv jetstream.KeyValue, key string) (leaderEntry, bool, error) {
	stream, prefix := kvStream(kv)
	e, ok, err := f.leaderLast(ctx, stream, prefix+key)
	e.key = key
	return e, ok, err
}

// leaderJSON reads key of kv from the stream's leader (leaderGet, retried) into v, and
// returns its revision; ok is false when the key has none.
func (f *Fleet) leaderJSON(ctx context.Context, kv jetstream.KeyValue, key string, v any) (rev uint64, ok bool, err error) {
	e, ok, err := f.leaderEntryJSON(ctx, kv, key, v)
	return e.rev, ok, err
}

// leaderEntryJSON is leaderJSON returning the entry read: for a key read as none, its
// expiredAt.
func (f *Fleet) leaderEntryJSON(ctx context.Context, kv jetstream.KeyValue, key string, v any) (e leaderEntry, ok bool, err error) {
	err = retry(ctx, "get "+kv.Bucket()+" "+key, func(ctx context.Context) error {
		e, ok, err = f.leaderGet(ctx, kv, key)
		return err
	})
	if err != nil || !ok {
		return e, false, err
	}
	if err := json.Unmarshal(e.value, v); err != nil {
		return leaderEntry{}, false, fmt.Errorf("fleet: %s %s: %w", kv.Bucket(), key, err)
	}
	return e, true, nil
}

// kvStream names the stream that holds bucket kv and the subject prefix of its keys.
func kvStream(kv jetstream.KeyValue) (stream, prefix string) {
	return "KV_" + kv.Bucket(), "$KV." + kv.Bucket() + "."
}

// msgGetResponse is JetStream's answer to $JS.API.STREAM.MSG.GET.
type msgGetResponse struct {
	Message *struct {
		Seq    uint64    `json:"seq"`
		Header []byte    `json:"hdrs"`
		Data   []byte    `json:"data"`
		Time   time.Time `json:"time"`
	} `json:"message"`
	Error *struct {
		Code        int    `json:"code"`
		ErrCode     int    `json:"err_code"`
		Description string `json:"description"`
	} `json:"error"`
}

// leaderLast reads the last message of subj in stream through the stream's leader (the
// API's message get, not a direct get); ok is false when there is none or it marks
// the key deleted, purged or expired (an expiry's marker gives its time: expiredAt).
func (f *Fleet) leaderLast(ctx context.Context, stream, subj string) (leaderEntry, bool, error) {
	req, err := json.Marshal(struct {
		LastBySubject string `json:"last_by_subj"`
	}{subj})
	if err != nil {
		return leaderEntry{}, false, err
	}
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	msg, err := f.nc.RequestWithContext(ctx, "$JS.API.STREAM.MSG.GET."+stream, req)
	if err != nil {
		return leaderEntry{}, false, fmt.Errorf("fleet: read %s: %w", subj, err)
	}
	var resp msgGetResponse
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return leaderEntry{}, false, fmt.Errorf("fleet: read %s: %w", subj, err)
	}
	if resp.Error != nil {
		if resp.Error.Code == 404 {
			return leaderEntry{}, false, nil
		}
		return leaderEntry{}, false, fmt.Errorf("fleet: read %s: %s (%d)", subj, resp.Error.Description, resp.Error.ErrCode)
	}
	if resp.Message == nil {
		return leaderEntry{}, false, fmt.Errorf("fleet: read %s: empty answer", subj)
	}
	if len(resp.Message.Header) > 0 {
		h, err := nats.DecodeHeadersMsg(resp.Message.Header)
		if err != nil {
			return leaderEntry{}, false, fmt.Errorf("fleet: read %s: %w", subj, err)
		}
		if h.Get("Nats-Marker-Reason") == "MaxAge" {
			return leaderEntry{expiredAt: resp.Message.Time}, false, nil
		}
		if op := h.Get("KV-Operation"); op == "DEL" || op == "PURGE" || h.Get("Nats-Marker-Reason") != "" {
			return leaderEntry{}, false, nil
		}
	}
	return leaderEntry{rev: resp.Message.Seq, value: resp.Message.Data}, true, nil
}

// HeartbeatLeader names the NATS server that leads the stream of the fleet's
// heartbeat bucket, asked over nc (an embedded server is named after its node). Every
// node's heartbeats stall while that stream elects a new leader, as when the leader's
// node dies: a benchmark that kills that node measures the fleet's worst case.
func HeartbeatLeader(ctx context.Context, nc *nats.Conn) (string, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return "", err
	}
	s, err := js.Stream(ctx, "KV_"+bucketNodes)
	if err != nil {
		return "", fmt.Errorf("fleet: heartbeat stream: %w", err)
	}
	info := s.CachedInfo()
	if info.Cluster == nil || info.Cluster.Leader == "" {
		return "", fmt.Errorf("fleet: heartbeat stream %s has no leader", "KV_"+bucketNodes)
	}
	return info.Cluster.Leader, nil
}
