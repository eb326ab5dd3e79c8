package idempotency

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed lua/claim.lua
	claimLua string
	//go:embed lua/complete.lua
	completeLua string
	//go:embed lua/release.lua
	releaseLua string
	//go:embed lua/heartbeat.lua
	heartbeatLua string
	//go:embed lua/abandoned.lua
	abandonedLua string
)

// RedisOptions configures a RedisStore. The zero value of every field is its
// documented default.
type RedisOptions struct {
	// Prefix starts every key and channel the store uses. It must not hold
	// '{' or '}', which would change the keys' hash slots. Default "idem:".
	Prefix string
}

// RedisStore keeps records in Redis: standalone or Sentinel (a
// *redis.Client), or Cluster (a *redis.ClusterClient). Every transition is
// one Lua script judged by the Redis server's clock; every key of one record
// shares a hash tag, so every script runs on one slot. A claim that finds a
// completed record returns its response in the same round trip.
//
// Waiters are woken by pub/sub: one connection per store on standalone
// Redis, and on a cluster sharded pub/sub with one connection per master,
// which follows a slot when it moves to another master.
type RedisStore struct {
	c        redis.UniversalClient
	prefix   string
	publish  string // the command that wakes waiters, run by the scripts
	claim    *redis.Script
	complete *redis.Script
	release  *redis.Script
	beat     *redis.Script
	sweep    *redis.Script
	waits    *waiters
}

// NewRedisStore returns a store on c: a *redis.ClusterClient makes it use
// the cluster's sharded pub/sub; any other client is taken for one server
// (a Sentinel failover client is one). It panics if o.Prefix holds a brace.
// Close it to release its pub/sub connections.
func NewRedisStore(c redis.UniversalClient, o RedisOptions) *RedisStore {
	if o.Prefix == "" {
		o.Prefix = "idem:"
	}
	if strings.ContainsAny(o.Prefix, "{}") {
		panic(fmt.Sprintf("idempotency: RedisOptions.Prefix %q holds a brace", o.Prefix))
	}
	s := &RedisStore{
		c:        c,
		prefix:   o.Prefix,
		publish:  "PUBLISH",
		claim:    redis.NewScript(claimLua),
		complete: redis.NewScript(completeLua),
		release:  redis.NewScript(releaseLua),
		beat:     redis.NewScript(heartbeatLua),
		sweep:    redis.NewScript(abandonedLua),
	}
	if cc, ok := c.(*redis.ClusterClient); ok {
		s.publish, s.waits = "SPUBLISH", newShardedWaiters(cc)
	} else {
		s.waits = newWaiters(c)
	}
	return s
}

// Close releases the store's pub/sub connections; it does not close the
// client. Waiters still waiting fall back to re-reading on a timer.
func (s *RedisStore) Close() error { return s.waits.close() }

// buckets is the number of hash tags records are spread over. Records share
// a tag with their bucket's token sequence and in-flight index, so a claim
// is one script on one slot; 1024 tags still spread records over every
// master of a cluster, and a sweep reads 1024 small indexes, whatever the
// number of records kept.
const buckets = 1024

// recordKeys returns the record's key, and its bucket's token sequence and
// in-flight index.
func (s *RedisStore) recordKeys(k Key) (rec, seq, leases string) {
	tag := s.bucketTag(bucketOf(k))
	return tag + recordName(k), tag + "seq", tag + "leases"
}

// recordName spells k inside a bucket. The scope is length-prefixed, so no
// (scope, name) pair can be spelled as another, and the spelling parses
// back (see parseRecordName).
func recordName(k Key) string {
	return strconv.Itoa(len(k.Scope)) + ":" + k.Scope + ":" + k.Name
}

func parseRecordName(s string) (Key, bool) {
	n, rest, ok := strings.Cut(s, ":")
	l, err := strconv.Atoi(n)
	if !ok || err != nil || l < 0 || len(rest) < l+1 || rest[l] != ':' {
		return Key{}, false
	}
	return Key{Scope: rest[:l], Name: rest[l+1:]}, true
}

// bucketTag is the prefix, hash tag included, of a bucket's keys.
func (s *RedisStore) bucketTag(b uint32) string {
	return s.prefix + "{" + strconv.FormatUint(uint64(b), 10) + "}:"
}

func bucketOf(k Key) uint32 {
	// FNV-1a: stable across processes and versions. Collisions only share a
	// bucket; the key itself below is unambiguous.
	h := uint32(2166136261)
	for _, part := range [2]string{k.Scope, k.Name} {
		for i := 0; i < len(part); i++ {
			h = (h ^ uint32(part[i])) * 16777619
		}
		h *= 16777619
	}
	return h % buckets
}

// Claim implements Store.
func (s *RedisStore) Claim(ctx context.Context, req ClaimRequest) (Claim, error) {
	rec, seq, leases := s.recordKeys(req.Key)
	watch := "0"
	if req.Watch {
		watch = "1"
	}
	v, err := s.claim.Run(ctx, s.c, []string{rec, seq, leases},
		req.Fingerprint[:], req.OperationID, req.Lease.Milliseconds(), req.Retention.Milliseconds(), watch).Slice()
	if err != nil {
		return Claim{}, unavailable("claim", err)
	}
	c, err := parseClaim(v)
	if err != nil {
		return Claim{}, unavailable("claim", err)
	}
	return c, nil
}

func parseClaim(v []any) (Claim, error) {
	str := func(i int) string {
		if i < len(v) {
			if s, ok := v[i].(string); ok {
				return s
			}
		}
		return ""
	}
	switch str(0) {
	case "owner":
		attempt, err1 := strconv.Atoi(str(2))
		token, err2 := strconv.ParseUint(str(3), 10, 64)
		if err := errors.Join(err1, err2); err != nil {
			return Claim{}, err
		}
		return Claim{State: Owner, OperationID: str(1), Attempt: attempt, Token: token, Abandoned: str(4) == "1"}, nil
	case "completed":
		c := Claim{State: Completed, OperationID: str(1)}
		return c, c.Response.UnmarshalBinary([]byte(str(2)))
	case "inflight":
		ms, err := strconv.ParseInt(str(1), 10, 64)
		return Claim{State: InFlight, LeaseLeft: time.Duration(ms) * time.Millisecond}, err
	case "mismatch":
		return Claim{State: Mismatch}, nil
	}
	return Claim{}, fmt.Errorf("unexpected claim reply %q", v)
}

// Complete implements Store.
func (s *RedisStore) Complete(ctx context.Context, k Key, token uint64, resp Response, retention time.Duration) error {
	body, err := resp.MarshalBinary()
	if err != nil {
		return err
	}
	rec, _, leases := s.recordKeys(k)
	return fenced("complete", s.complete.Run(ctx, s.c, []string{rec, leases},
		strconv.FormatUint(token, 10), body, retention.Milliseconds(), s.publish).Err())
}

// Release implements Store.
func (s *RedisStore) Release(ctx context.Context, k Key, token uint64, forget bool) error {
	rec, _, leases := s.recordKeys(k)
	f := "0"
	if forget {
		f = "1"
	}
	return fenced("release", s.release.Run(ctx, s.c, []string{rec, leases},
		strconv.FormatUint(token, 10), f, s.publish).Err())
}

// Heartbeat implements Store.
func (s *RedisStore) Heartbeat(ctx context.Context, k Key, token uint64, lease time.Duration) error {
	rec, _, leases := s.recordKeys(k)
	return fenced("heartbeat", s.beat.Run(ctx, s.c, []string{rec, leases},
		strconv.FormatUint(token, 10), lease.Milliseconds()).Err())
}

// Subscribe implements Store: the record's key is also its channel.
func (s *RedisStore) Subscribe(ctx context.Context, k Key) (Subscription, error) {
	rec, _, _ := s.recordKeys(k)
	sub, err := s.waits.subscribe(ctx, rec)
	if err != nil {
		return nil, unavailable("subscribe", err)
	}
	return sub, nil
}

// Abandoned implements Store: one script per bucket, all in one pipeline.
func (s *RedisStore) Abandoned(ctx context.Context, limit int) ([]AbandonedRecord, error) {
	if err := s.sweep.Load(ctx, s.c).Err(); err != nil {
		return nil, unavailable("abandoned", err)
	}
	cmds, err := s.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for b := range uint32(buckets) {
			s.sweep.EvalSha(ctx, p, []string{s.bucketTag(b) + "leases"}, limit)
		}
		return nil
	})
	if err != nil {
		return nil, unavailable("abandoned", err)
	}
	var out []AbandonedRecord
	for b, cmd := range cmds {
		v, _ := cmd.(*redis.Cmd).Slice()
		tag := s.bucketTag(uint32(b))
		for i := 0; i+1 < len(v) && len(out) < limit; i += 2 {
			rec, _ := v[i].(string)
			fp, _ := v[i+1].(string)
			k, ok := parseRecordName(strings.TrimPrefix(rec, tag))
			if !ok || len(fp) != len(Fingerprint{}) || !strings.HasPrefix(rec, tag) {
				return nil, unavailable("abandoned", fmt.Errorf("unexpected entry %q in %sleases", rec, tag))
			}
			out = append(out, AbandonedRecord{Key: k, Fingerprint: Fingerprint([]byte(fp))})
		}
	}
	return out, nil
}

// fenced maps a script's FENCED reply to ErrFenced and any other failure to
// ErrUnavailable.
func fenced(op string, err error) error {
	var re redis.Error
	switch {
	case err == nil:
		return nil
	case errors.As(err, &re) && strings.HasPrefix(re.Error(), "FENCED"):
		return fmt.Errorf("%w: %s", ErrFenced, op)
	}
	return unavailable(op, err)
}
