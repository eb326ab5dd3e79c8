package idempotency

import (
	"compress/flate"
	"context"
	"crypto/sha1"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idempotency-go/idempotency/internal/storeerr"
	"github.com/idempotency-go/idempotency/internal/wire"
)

var (
	//go:embed lua/record.lua
	recordLua string
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
	//go:embed lua/inspect.lua
	inspectLua string
	//go:embed lua/inflight.lua
	inflightLua string
	//go:embed lua/point.lua
	pointLua string
	//go:embed lua/points.lua
	pointsLua string
)

// scripts are the store's Lua scripts, one per transition, each named for
// its file in lua/.
type scripts struct {
	claim, complete, release, heartbeat, abandoned *script
	point, points                                  *script // recovery points
	inspect, inflight                              *script // an operator's reads
}

// script is one of the store's Lua scripts, the record's encoding
// (lua/record.lua) before it. It is run as go-redis's Script runs one,
// EVALSHA and EVAL when the server lacks it, but from one argument slice
// the caller fills: the hot paths then box no argument twice.
type script struct {
	src     string
	evalsha [2]any // "evalsha" and the digest, boxed once
}

func newScript(body string) *script {
	src := recordLua + body
	sum := sha1.Sum([]byte(src))
	return &script{src: src, evalsha: [2]any{"evalsha", hex.EncodeToString(sum[:])}}
}

// args starts the command that runs sc on numKeys keys, with room for the
// keys and arguments to come, n in all.
func (sc *script) args(numKeys string, n int) []any {
	return append(append(make([]any, 0, 3+n), sc.evalsha[:]...), numKeys)
}

// bySource turns args, made by sc.args, into an EVAL of sc's source.
func (sc *script) bySource(args []any) {
	args[0], args[1] = "eval", sc.src
}

// run sends args, made by sc.args, on c.
func (sc *script) run(ctx context.Context, c redis.UniversalClient, args []any) *redis.Cmd {
	cmd := redis.NewCmd(ctx, args...)
	_ = c.Process(ctx, cmd)
	return sc.loaded(ctx, c, args, cmd)
}

// loaded returns cmd, the reply to args (made by sc.args), or when the
// server lacked the script, the reply to sending it by source.
func (sc *script) loaded(ctx context.Context, c redis.UniversalClient, args []any, cmd *redis.Cmd) *redis.Cmd {
	if !noScript(cmd.Err()) {
		return cmd
	}
	sc.bySource(args)
	cmd = redis.NewCmd(ctx, args...)
	_ = c.Process(ctx, cmd)
	return cmd
}

// noScript reports the server's answer to an EVALSHA of a script it lacks.
func noScript(err error) bool {
	// err first: HasErrorPrefix allocates even for no error.
	return err != nil && redis.HasErrorPrefix(err, "NOSCRIPT")
}

// RedisOptions configures a RedisStore. The zero value of every field is its
// documented default.
type RedisOptions struct {
	// Prefix starts every key and channel the store uses. It must not hold
	// '{' or '}', which would change the keys' hash slots. Default "idem:".
	Prefix string
	// Replicas, when above 0, has the writes that decide whether an
	// operation runs and what it answered confirmed by that many replicas of
	// the record's master (Redis WAIT, in the same round trip as the
	// script), so that a failover to one of them cannot undo them: a claim
	// that makes the caller the owner, a completion, a release. When fewer
	// confirm within ReplicaTimeout, the call fails with ErrUnavailable
	// and the operation does not run (see Claim and Complete). Other claims
	// (replays, duplicates in flight) ignore the count, though they too wait
	// up to ReplicaTimeout while replicas are missing. Default 0: nothing
	// waits, and a failover may lose the writes of the moments before it.
	Replicas int
	// ReplicaTimeout bounds each wait for Replicas; it must be below the
	// client's ReadTimeout. Default 1s.
	ReplicaTimeout time.Duration
	// Fsync, when set, has the writes that Replicas covers (a claim that
	// makes the caller the owner, a completion, a release, a saved recovery
	// point) wait until they are in the append-only file on disk, fsynced,
	// on the record's master and on as many of its replicas as it says
	// (Redis WAITAOF, Redis 7.2 or later and Valkey 8: one after the
	// scripts sent together to a master, so that they share one fsync), so
	// that a power loss or an operating system's crash cannot undo them.
	// When the servers do not confirm within Fsync.Timeout, the call fails
	// with ErrUnavailable and the operation does not run, as with Replicas.
	// A master that cannot wait for its append-only file (appendonly no,
	// appendfsync no or, with Fsync.Master, everysec, a server without
	// WAITAOF) is refused with an error that names it, by CheckPersistence
	// and by the store's calls to it, until it is asked again after a
	// back-off and found able; a claim on it is sent nothing, and an
	// owner's write is stored without the wait and fails saying so (see
	// Fsync). Default: nothing waits for the disk.
	Fsync Fsync
	// CompressAbove, when above 0, stores a response whose body is larger
	// than that many bytes compressed (DEFLATE, fastest level), when that
	// makes it smaller: a 10 KiB JSON body takes about a third of its
	// size, for some tens of microseconds of CPU at completion and at each
	// replay. Every store of this version reads compressed records, set or
	// not; an earlier version fails a replay of one with ErrUnavailable
	// rather than answer wrongly, so set it once every instance runs this
	// version. Default 0: nothing is compressed.
	CompressAbove int
}

// RedisStore keeps records in Redis: standalone or Sentinel (a
// *redis.Client), or Cluster (a *redis.ClusterClient). Every transition is
// one Lua script judged by the Redis server's clock; every key of one record
// shares a hash tag, so every script runs on one slot. A claim that finds a
// completed record returns its response in the same round trip.
//
// Under load, the scripts of concurrent calls share round trips: while a
// few are in flight, the calls that follow queue and go out together in one
// pipeline (go-redis hooks see a pipeline). A queued call still returns when
// its context ends, with its context's error: one not yet sent is never
// sent, and one already on its way may or may not have been applied.
//
// Set ContextTimeoutEnabled on the client: go-redis then ends a call on a
// silent connection at its context's deadline rather than at its own
// ReadTimeout, so the Guard's deadlines (Options.ClaimTimeout, the lease's
// local end) bound every call, and on a *redis.Client the Guard waits for
// an owner's outcome on the caller's goroutine instead of one of its own
// (not with a ReadTimeout or WriteTimeout of -2, which turns go-redis's
// socket deadlines off, the context's too). A go-redis hook runs within
// those calls: one that ignores its context's deadline holds them as long.
// With RedisOptions.Replicas set, the scripts sent together to a master
// share the one WAIT that follows them; with RedisOptions.Fsync, the one
// WAITAOF.
//
// Waiters are woken by pub/sub: one connection per store on standalone
// Redis, and on a cluster sharded pub/sub with one connection per master,
// which follows a slot when it moves to another master.
type RedisStore struct {
	c       redis.UniversalClient
	prefix  string
	publish any // the command that wakes waiters, run by the scripts; boxed once
	scripts scripts
	pubsub  *pubsub
	batch   *batcher
	// confirmed holds, with Replicas or Fsync set, a *confirmedNode for
	// each master (a *redis.Client): its batcher, whose batches end with a
	// WAIT for replicas or a WAITAOF.
	confirmed sync.Map
	buckets   [buckets]bucketKeys
	// endsByDeadline: the client, a *redis.Client, honours its calls'
	// deadlines (ContextTimeoutEnabled, with socket deadlines not turned
	// off by a ReadTimeout or WriteTimeout of -2), and so do the batchers.
	endsByDeadline bool

	replicas       int
	replicaTimeout time.Duration
	fsync          Fsync
	// fsyncSchedule is when a master is asked again whether it can wait
	// for its append-only file; set by NewRedisStore, only read after.
	fsyncSchedule fsyncSchedule
	// compressAbove is RedisOptions.CompressAbove; compressors holds
	// *flate.Writer values for it to reuse.
	compressAbove int
	compressors   sync.Pool
	// master returns a client of the server holding key, for WAIT: it
	// covers only the writes made on its own connection.
	master func(ctx context.Context, key string) (*redis.Client, error)
	reload func(ctx context.Context) // refreshes the cluster's slot map
}

// NewRedisStore returns a store on c, which must be a *redis.Client
// (standalone, or Sentinel through redis.NewFailoverClient) or a
// *redis.ClusterClient, as redis.NewUniversalClient returns: the store
// wakes waiters through pub/sub on the server that holds each record, which
// it finds through the concrete client (sharded pub/sub on a cluster).
// Any other client, such as a *redis.Ring, which spreads one record's
// channel and keys by its own rules, or a type wrapping a client, is
// refused; instrument a client with go-redis hooks (AddHook) instead of
// wrapping it. NewRedisStore also refuses a Prefix holding a brace, a
// negative Replicas or Fsync.Replicas, and waits (ReplicaTimeout with
// Replicas set, Fsync.Timeout with Fsync set, or both added up) not below
// c's ReadTimeout. It does not reach the servers: CheckEviction and
// CheckPersistence do, at start-up.
// Close the store to release its pub/sub connections.
func NewRedisStore(c redis.UniversalClient, o RedisOptions) (*RedisStore, error) {
	if o.Prefix == "" {
		o.Prefix = "idem:"
	}
	if strings.ContainsAny(o.Prefix, "{}") {
		return nil, fmt.Errorf("idempotency: RedisOptions.Prefix %q holds a brace, which would change the keys' hash slots", o.Prefix)
	}
	if o.Replicas < 0 || o.Fsync.Replicas < 0 {
		return nil, fmt.Errorf("idempotency: RedisOptions asks for %d replicas and Fsync.Replicas %d; want 0 or more", o.Replicas, o.Fsync.Replicas)
	}
	if o.ReplicaTimeout <= 0 {
		o.ReplicaTimeout = time.Second
	}
	if o.Fsync.Timeout <= 0 {
		o.Fsync.Timeout = time.Second
	}
	// WAIT and WAITAOF count whole milliseconds, and 0 would wait for ever.
	o.ReplicaTimeout = max(o.ReplicaTimeout, time.Millisecond)
	o.Fsync.Timeout = max(o.Fsync.Timeout, time.Millisecond)
	s := &RedisStore{
		c:      c,
		prefix: o.Prefix,
		scripts: scripts{
			claim:     newScript(claimLua),
			complete:  newScript(completeLua),
			release:   newScript(releaseLua),
			heartbeat: newScript(heartbeatLua),
			abandoned: newScript(abandonedLua),
			point:     newScript(pointLua),
			points:    newScript(pointsLua),
			inspect:   newScript(inspectLua),
			inflight:  newScript(inflightLua),
		},
		replicas:       o.Replicas,
		replicaTimeout: o.ReplicaTimeout,
		fsync:          o.Fsync,
		fsyncSchedule:  defaultFsyncSchedule(),
		compressAbove:  o.CompressAbove,
		batch:          &batcher{send: sendScripts(c)},
	}
	for b := range s.buckets {
		tag := s.bucketTag(uint32(b))
		s.buckets[b] = bucketKeys{seq: tag + "seq", leases: tag + "leases"}
	}
	readTimeout, err := s.useClient(c)
	if err != nil {
		return nil, err
	}
	if err := o.checkWaits(readTimeout); err != nil {
		return nil, err
	}
	return s, nil
}

// checkWaits refuses waits that add up to the client's ReadTimeout or more:
// WAIT and WAITAOF are read, pipelined, within it, and a read that times out
// would have go-redis run the scripts again.
func (o RedisOptions) checkWaits(readTimeout time.Duration) error {
	var waits time.Duration
	var named []string
	if o.Replicas > 0 {
		waits += o.ReplicaTimeout
		named = append(named, fmt.Sprintf("ReplicaTimeout %v", o.ReplicaTimeout))
	}
	if o.Fsync.on() {
		waits += o.Fsync.Timeout
		named = append(named, fmt.Sprintf("Fsync.Timeout %v", o.Fsync.Timeout))
	}
	if waits > 0 && readTimeout > 0 && waits >= readTimeout {
		return fmt.Errorf("idempotency: RedisOptions.%s is not below the client's ReadTimeout %v", strings.Join(named, " plus "), readTimeout)
	}
	return nil
}

// useClient sets what s does differently on a cluster, and returns the
// client's ReadTimeout. Only the concrete clients are accepted: s finds the
// server that holds a record, and so where to listen for its wake-ups,
// through them.
func (s *RedisStore) useClient(c redis.UniversalClient) (readTimeout time.Duration, err error) {
	switch c := c.(type) {
	case *redis.ClusterClient:
		s.publish, s.pubsub, s.master, s.reload = "SPUBLISH", newShardedPubsub(c), c.MasterForKey, c.ReloadState
		// Not endsByDeadline: with ContextTimeoutEnabled, go-redis v9.23
		// gives the lookup of its command table, until one succeeds, a 5s
		// deadline of its own instead of the call's.
		readTimeout = c.Options().ReadTimeout
	case *redis.Client:
		s.publish, s.pubsub = "PUBLISH", newPubsub(c)
		s.master = func(context.Context, string) (*redis.Client, error) { return c, nil }
		s.reload = func(context.Context) {}
		// A timeout below 0 (the option's -2) has go-redis set no socket
		// deadline at all, the context's neither.
		opt := c.Options()
		readTimeout = opt.ReadTimeout
		s.endsByDeadline = opt.ContextTimeoutEnabled && opt.ReadTimeout >= 0 && opt.WriteTimeout >= 0
	default:
		return 0, fmt.Errorf("idempotency: NewRedisStore needs a *redis.Client or a *redis.ClusterClient, not %T", c)
	}
	return readTimeout, nil
}

// Close releases the store's pub/sub connections; it does not close the
// client. Waiters still waiting fall back to re-reading on a timer.
func (s *RedisStore) Close() error { return s.pubsub.close() }

// EndsByDeadline implements DeadlineBound: a RedisStore vouches on a
// *redis.Client with ContextTimeoutEnabled and socket deadlines on, without
// which go-redis holds a call on a silent connection for its own timeouts.
func (s *RedisStore) EndsByDeadline(as Store) bool { return as == Store(s) && s.endsByDeadline }

// Claim implements Store. With RedisOptions.Replicas or Fsync set, a claim
// that makes the caller the owner is confirmed by as many replicas, or
// fsynced as asked, before it is returned. When it is not, the operation
// must not run, since a failover or a restart could hand the record to a
// second owner, so Claim returns ErrUnavailable and gives the record up at
// once rather than when the lease runs out: a record it created is
// deleted, one it took over is released, and one whose previous owner was
// abandoned stays abandoned, so that the next owner still learns that an
// earlier attempt may have acted.
func (s *RedisStore) Claim(ctx context.Context, req ClaimRequest) (Claim, error) {
	if l := len(req.OperationID); l == 0 || l > 255 {
		// A record stores its length in one byte.
		return Claim{}, fmt.Errorf("idempotency: operation ID of %d bytes, want 1..255", l)
	}
	ks, bk := s.keysOf(req.Key)
	args := append(s.scripts.claim.args("4", 9), &ks.rec, &ks.points, bk.seq, bk.leases, string(req.Fingerprint[:]), req.OperationID,
		req.Lease.Milliseconds(), req.Retention.Milliseconds(), luaBool(req.Watch))
	cmd, unconfirmed := s.eval(ctx, s.scripts.claim, args, func(cmd *redis.Cmd) bool {
		switch v := cmd.Val().(type) {
		case int64:
			return true
		case []any:
			return len(v) > 0 && v[0] == "owner"
		}
		return false
	})
	if err := cmd.Err(); err != nil {
		return Claim{}, unavailable("claim", err)
	}
	c, err := parseClaim(cmd.Val(), req.OperationID)
	if err != nil {
		return Claim{}, storeerr.Unavailable("claim", err)
	}
	if unconfirmed != nil {
		s.giveUp(context.WithoutCancel(ctx), req.Key, c)
		return Claim{}, unavailable("claim", unconfirmed)
	}
	return c, nil
}

// giveUp ends an owner's claim that was not confirmed, before anything ran
// (see Claim). Should it fail, the lease runs out instead.
func (s *RedisStore) giveUp(ctx context.Context, k Key, c Claim) {
	d := untouched(c)
	if d == abandon {
		_ = s.Abandon(ctx, k, c.Token)
		return
	}
	// Not Release or Forget: their wait for replicas or the disk would fail
	// as the claim's did. The release script forgets or releases as d says.
	_ = s.scripts.release.run(ctx, s.c, s.releaseArgs(k, c.Token, d == Forget))
}

// eval runs sc with args (made by sc.args) on the record they name,
// through a batcher, and returns the script's reply, or its failure, in cmd.
//
// With RedisOptions.Replicas or Fsync set, the script goes out in a
// pipeline that ends with a WAIT for replicas and a WAITAOF, on a
// connection to the record's master, since both cover only the writes made
// on their own connection. If the reply reports a change worth keeping (any
// reply that is not an error when durable is nil, or one that durable
// accepts) and the replicas did not confirm it, or it was not fsynced as
// asked, unconfirmed says why: a failover or a power loss may lose that
// change. On a master refused by fsyncReady (errCannotFsync), a claim
// (durable set) is sent nothing: cmd fails with the refusal. An owner's
// write (durable nil) is sent without the WAITAOF, and unconfirmed is the
// refusal: its operation may have acted, and its change kept unfsynced
// loses less than none (see Fsync).
func (s *RedisStore) eval(ctx context.Context, sc *script, args []any, durable func(*redis.Cmd) bool) (cmd *redis.Cmd, unconfirmed error) {
	if s.replicas == 0 && !s.fsync.on() {
		return s.batch.run(ctx, sc, args).cmd, nil
	}
	keep := func(cmd *redis.Cmd) bool { return cmd.Err() == nil && (durable == nil || durable(cmd)) }
	// args[3], the first key, is a record's (see recordKeys).
	node, err := s.master(ctx, *args[3].(*string))
	if err != nil {
		return failedCmd(err), nil
	}
	cn := s.confirmedNode(node)
	refused := s.fsyncReady(ctx, node, cn)
	if refused != nil && (durable != nil || !errors.Is(refused, errCannotFsync)) {
		return failedCmd(refused), nil
	}
	bc := s.send(ctx, node, cn, sc, args, refused == nil)
	cmd = bc.cmd
	var reply redis.Error
	switch err := cmd.Err(); {
	case isRedirect(err):
		// The slot is moving, and nothing ran. The cluster client follows
		// it, but a WAIT or WAITAOF there would not cover the script's
		// connection.
		cmd = sc.run(ctx, s.c, args)
		if keep(cmd) {
			return cmd, errors.New("not confirmed: the record's slot is moving")
		}
		return cmd, nil
	case err != nil && !errors.As(err, &reply):
		// The master may be gone: the cluster client would notice on its
		// own commands only.
		s.reload(ctx)
	}
	if !keep(cmd) {
		return cmd, nil
	}
	return cmd, s.confirmation(ctx, node, cn, bc, refused)
}

// send sends sc with args on node, a master: with fsync, through cn's
// batcher, whose pipelines end with the WAITAOF, and otherwise in a
// pipeline of its own without one. A script the server lacks is sent again
// by source.
func (s *RedisStore) send(ctx context.Context, node *redis.Client, cn *confirmedNode, sc *script, args []any, fsync bool) *batchCall {
	var bc *batchCall
	if fsync {
		bc = cn.batch.run(ctx, sc, args)
	} else {
		bc = &batchCall{sc: sc, args: args}
		s.sendConfirmed(node, false)(ctx, []*batchCall{bc})
	}
	if noScript(bc.cmd.Err()) {
		sc.bySource(args)
		bc = &batchCall{sc: sc, args: args}
		s.sendConfirmed(node, fsync)(ctx, []*batchCall{bc})
	}
	return bc
}

// confirmation judges the replies of the WAIT and the WAITAOF sent after
// bc's script: nil when they confirm what RedisOptions asks. refused, when
// set, is why bc went without a WAITAOF (see eval): it is not confirmed.
func (s *RedisStore) confirmation(ctx context.Context, node *redis.Client, cn *confirmedNode, bc *batchCall, refused error) error {
	if s.replicas > 0 {
		switch n, err := bc.acks.Int64(); {
		case err != nil:
			s.reloadIfReplica(ctx, err)
			return fmt.Errorf("waiting for replicas: %w", err)
		case n < int64(s.replicas):
			return fmt.Errorf("%d of %d replicas acknowledged within %v", n, s.replicas, s.replicaTimeout)
		}
	}
	switch {
	case !s.fsync.on():
		return nil
	case refused != nil:
		return refused
	}
	v, err := bc.fsynced.Int64Slice()
	switch {
	case err != nil:
		if refused := s.fsyncRefusal(node, err); refused != nil {
			// appendonly switched off since the master was asked, say.
			return cn.refuse(refused, s.fsyncSchedule)
		}
		s.reloadIfReplica(ctx, err)
		return fmt.Errorf("waiting for the append-only file: %w", err)
	case len(v) != 2:
		return fmt.Errorf("unexpected WAITAOF reply %v", v)
	case v[0] < int64(s.fsync.local()) || v[1] < int64(s.fsync.Replicas):
		return fmt.Errorf("the append-only file fsynced on %d of %d masters and %d of %d replicas within %v",
			v[0], s.fsync.local(), v[1], s.fsync.Replicas, s.fsync.Timeout)
	}
	return nil
}

// reloadIfReplica refreshes the cluster's slot map when err, the reply to
// a WAIT or WAITAOF, says that the node the store took for a master is a
// replica now: a failover moved its slots.
func (s *RedisStore) reloadIfReplica(ctx context.Context, err error) {
	if strings.Contains(err.Error(), "replica") {
		s.reload(ctx)
	}
}

// sendConfirmed sends batches on node, a master, each in one pipeline with
// one WAIT and, with fsync, one WAITAOF after its scripts, as RedisOptions
// asks, which go-redis writes on one connection: each covers every write
// made before it on its connection, so one confirms them all, and the
// scripts share one fsync. A WAIT or WAITAOF after scripts that wrote
// nothing returns at once, unless replicas are missing or lag.
func (s *RedisStore) sendConfirmed(node *redis.Client, fsync bool) func(context.Context, []*batchCall) {
	return func(ctx context.Context, batch []*batchCall) {
		_, err := node.Pipelined(ctx, func(p redis.Pipeliner) error {
			queueScripts(ctx, p, batch)
			var acks, fsynced *redis.Cmd
			if s.replicas > 0 {
				acks = p.Do(ctx, "WAIT", s.replicas, s.replicaTimeout.Milliseconds())
			}
			if fsync && s.fsync.on() {
				fsynced = p.Do(ctx, "WAITAOF", s.fsync.local(), s.fsync.Replicas, s.fsync.Timeout.Milliseconds())
			}
			for _, bc := range batch {
				bc.acks, bc.fsynced = acks, fsynced
			}
			return nil
		})
		unanswered(batch, err)
	}
}

// unavailable is the failure of op, err: an error wrapping ErrUnavailable,
// unless err says that RedisOptions.Fsync cannot be met (errCannotFsync):
// the master answers, and Options.FailOpen must not run operations
// unguarded on it.
func unavailable(op string, err error) error {
	if errors.Is(err, errCannotFsync) {
		return fmt.Errorf("%s: %w", op, err)
	}
	return storeerr.Unavailable(op, err)
}

// isRedirect reports a cluster's MOVED or ASK reply: the command did not
// run on that node.
func isRedirect(err error) bool {
	var reply redis.Error
	return errors.As(err, &reply) && (strings.HasPrefix(reply.Error(), "MOVED ") || strings.HasPrefix(reply.Error(), "ASK "))
}

// parseClaim reads the claim script's reply to a claim by id.
func parseClaim(reply any, id string) (Claim, error) {
	var v []any
	switch r := reply.(type) {
	case int64:
		// A new record: its maker's id is the operation ID.
		return Claim{State: Owner, OperationID: id, Attempt: 1, Token: uint64(r)}, nil
	case string:
		return completedClaim(r)
	case []any:
		v = r
	}
	str := func(i int) string {
		if i < len(v) {
			if s, ok := v[i].(string); ok {
				return s
			}
		}
		return ""
	}
	// The scripts compute with doubles, which a value another program wrote
	// under the record's key can take beyond what they format exactly
	// (Redis's string.format('%d') of 1e20 is -2^63): a reply no record of
	// this version yields fails rather than make up an owner or a lease.
	switch str(0) {
	case "owner":
		attempt, err1 := strconv.Atoi(str(2))
		token, err2 := strconv.ParseUint(str(3), 10, 64)
		if err := errors.Join(err1, err2); err != nil {
			return Claim{}, err
		}
		if attempt < 1 || str(1) == "" {
			return Claim{}, fmt.Errorf("unexpected claim reply %q", reply)
		}
		return Claim{State: Owner, OperationID: str(1), Attempt: attempt, Token: token, Abandoned: str(4) == luaBool(true)}, nil
	case "inflight":
		ms, err := strconv.ParseInt(str(1), 10, 64)
		if err != nil {
			return Claim{}, err
		}
		if ms <= 0 || ms > int64(math.MaxInt64/time.Millisecond) {
			// A waiter re-reads within the lease left: one of 0 would have
			// it claim again and again.
			return Claim{}, fmt.Errorf("unexpected claim reply %q", reply)
		}
		return Claim{State: InFlight, LeaseLeft: time.Duration(ms) * time.Millisecond}, nil
	case "mismatch":
		return Claim{State: Mismatch}, nil
	}
	return Claim{}, fmt.Errorf("unexpected claim reply %q", reply)
}

// Complete implements Store. With RedisOptions.Replicas set, a completion
// not confirmed by as many replicas returns ErrUnavailable, though the
// master keeps it: a retry finds the outcome, unless a failover lost it.
func (s *RedisStore) Complete(ctx context.Context, k Key, token uint64, resp Response, retention time.Duration) error {
	ks, bk := s.keysOf(k)
	body := s.storedForm(resp)
	args := append(s.scripts.complete.args("3", 7), &ks.rec, &ks.points, bk.leases, strconv.FormatUint(token, 10), body, retention.Milliseconds(), s.publish)
	cmd, unconfirmed := s.eval(ctx, s.scripts.complete, args, nil)
	return settled("complete", cmd, unconfirmed)
}

// storedForm is resp as a completed record keeps it: compressed when its
// body is over RedisOptions.CompressAbove.
func (s *RedisStore) storedForm(resp Response) []byte {
	if s.compressAbove <= 0 || len(resp.Body) <= s.compressAbove {
		return wire.AppendResponse(nil, resp.Status, resp.Header, resp.Body)
	}
	fw, _ := s.compressors.Get().(*flate.Writer)
	if fw == nil {
		fw, _ = flate.NewWriter(nil, flate.BestSpeed) // fails only for a bad level
	}
	defer s.compressors.Put(fw)
	return wire.AppendCompressed(nil, resp.Status, resp.Header, resp.Body, fw)
}

// Release implements Store. With RedisOptions.Replicas set, a release not
// confirmed by as many replicas returns ErrUnavailable, though the master
// keeps it.
func (s *RedisStore) Release(ctx context.Context, k Key, token uint64) error {
	cmd, unconfirmed := s.eval(ctx, s.scripts.release, s.releaseArgs(k, token, false), nil)
	return settled("release", cmd, unconfirmed)
}

// Forget implements Store, as Release does.
func (s *RedisStore) Forget(ctx context.Context, k Key, token uint64) error {
	cmd, unconfirmed := s.eval(ctx, s.scripts.release, s.releaseArgs(k, token, true), nil)
	return settled("forget", cmd, unconfirmed)
}

// releaseArgs runs release.lua for the owner of token: it deletes the
// record and its recovery points with forget, and releases it otherwise.
func (s *RedisStore) releaseArgs(k Key, token uint64, forget bool) []any {
	ks, bk := s.keysOf(k)
	return append(s.scripts.release.args("3", 6), &ks.rec, &ks.points, bk.leases, strconv.FormatUint(token, 10), luaBool(forget), s.publish)
}

// luaBool is a flag as the scripts read and write them, boxed as a script
// argument: a constant in an interface costs no allocation, where a string
// returned and then boxed would cost one per call.
func luaBool(b bool) any {
	if b {
		return "1"
	}
	return "0"
}

// settled is the outcome of an owner's write run by eval. A write the
// master kept but could not fsync (errCannotFsync) fails with
// ErrUnavailable, as one whose wait timed out, saying that it is stored:
// a retry replays it.
func settled(op string, cmd *redis.Cmd, unconfirmed error) error {
	if err := fenced(op, cmd.Err()); err != nil {
		return err
	}
	if errors.Is(unconfirmed, errCannotFsync) {
		return storeerr.Unavailable(op, fmt.Errorf("%w: %w", errNotFsynced, unconfirmed))
	}
	if unconfirmed != nil {
		return unavailable(op, unconfirmed)
	}
	return nil
}

// Heartbeat implements Store.
func (s *RedisStore) Heartbeat(ctx context.Context, k Key, token uint64, lease time.Duration) error {
	return s.renew(ctx, k, token, lease)
}

// Abandon implements Store: heartbeat.lua with a lease that ends now.
func (s *RedisStore) Abandon(ctx context.Context, k Key, token uint64) error {
	return s.renew(ctx, k, token, 0)
}

func (s *RedisStore) renew(ctx context.Context, k Key, token uint64, lease time.Duration) error {
	ks, bk := s.keysOf(k)
	args := append(s.scripts.heartbeat.args("3", 5), &ks.rec, &ks.points, bk.leases, strconv.FormatUint(token, 10), lease.Milliseconds())
	return fenced("heartbeat", s.batch.run(ctx, s.scripts.heartbeat, args).cmd.Err())
}

// SaveRecoveryPoint implements RecoveryPointStore: point.lua appends p's
// entry to the record's recovery points (see lua/record.lua). With
// RedisOptions.Replicas set, a save not confirmed by as many replicas
// returns ErrUnavailable, though the master keeps it.
func (s *RedisStore) SaveRecoveryPoint(ctx context.Context, k Key, token uint64, p RecoveryPoint) error {
	ks, _ := s.keysOf(k)
	args := append(s.scripts.point.args("2", 4), &ks.rec, &ks.points, strconv.FormatUint(token, 10), wire.AppendPoint(nil, p.Step, p.Result))
	cmd, unconfirmed := s.eval(ctx, s.scripts.point, args, nil)
	return settled("save recovery point", cmd, unconfirmed)
}

// RecoveryPoints implements RecoveryPointStore: points.lua reads the
// record's recovery points.
func (s *RedisStore) RecoveryPoints(ctx context.Context, k Key, token uint64) ([]RecoveryPoint, error) {
	ks, _ := s.keysOf(k)
	args := append(s.scripts.points.args("2", 3), &ks.rec, &ks.points, strconv.FormatUint(token, 10))
	cmd := s.batch.run(ctx, s.scripts.points, args).cmd
	if err := fenced("recovery points", cmd.Err()); err != nil {
		return nil, err
	}
	entries, ok := cmd.Val().(string)
	if !ok {
		return nil, storeerr.Unavailable("recovery points", fmt.Errorf("unexpected reply %q", cmd.Val()))
	}
	ps, err := wire.ParsePoints([]byte(entries))
	if err != nil {
		return nil, storeerr.Unavailable("recovery points", err)
	}
	out := make([]RecoveryPoint, len(ps))
	for i, p := range ps {
		out[i] = RecoveryPoint(p)
	}
	return out, nil
}

// Subscribe implements Store: the record's key is also its channel.
func (s *RedisStore) Subscribe(ctx context.Context, k Key) (Subscription, error) {
	rec, _ := s.recordKey(k)
	sub, err := s.pubsub.subscribe(ctx, rec)
	if err != nil {
		return nil, storeerr.Unavailable("subscribe", err)
	}
	return sub, nil
}

// Stats counts the records in flight from the buckets' in-flight indexes,
// in one pipeline of two commands per bucket, judged by the clock of the
// server that answers TIME. A record whose retention ran out while in
// flight counts as abandoned until a sweep (ListAbandoned) prunes it from the
// index.
func (s *RedisStore) Stats(ctx context.Context) (Stats, error) {
	now, err := s.c.Time(ctx).Result()
	if err != nil {
		return Stats{}, storeerr.Unavailable("stats", err)
	}
	ms := strconv.FormatInt(now.UnixMilli(), 10)
	type counts struct{ all, due *redis.IntCmd }
	per := make([]counts, len(s.buckets))
	_, err = s.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for b := range s.buckets {
			key := s.buckets[b].leases.(string)
			per[b] = counts{p.ZCard(ctx, key), p.ZCount(ctx, key, "-inf", ms)}
		}
		return nil
	})
	if err != nil {
		return Stats{}, storeerr.Unavailable("stats", err)
	}
	var st Stats
	for _, c := range per {
		due := c.due.Val()
		st.Abandoned += due
		st.InFlight += c.all.Val() - due
	}
	return st, nil
}

// eachServer calls check for every node of a cluster, replicas too (at once,
// so check guards what it shares), or for the server a *redis.Client talks
// to, and returns the first error.
func (s *RedisStore) eachServer(ctx context.Context, check func(context.Context, *redis.Client) error) error {
	switch c := s.c.(type) {
	case *redis.ClusterClient:
		return c.ForEachShard(ctx, check)
	case *redis.Client:
		return check(ctx, c)
	}
	return nil
}

// CheckEviction reports whether the servers keep the store's keys until
// they expire. Under a maxmemory limit Redis evicts keys by its
// maxmemory-policy, and only noeviction keeps them: any other policy may
// drop a completed record (its retry runs the operation again), a record in
// flight (a retry becomes a second owner while the first still runs), and,
// for the allkeys policies, a token sequence (tokens are issued again).
// With noeviction, a full server refuses writes: claims fail closed with
// ErrUnavailable.
//
// It asks every node of a cluster, replicas too, since a failover promotes
// one; on a *redis.Client it asks the server the client talks to (a
// Sentinel's replicas are not asked). It returns nil when none of them may
// evict, an error wrapping ErrUnavailable when one cannot be reached, and
// otherwise an error naming each server that may evict, or that refused to
// say (INFO denied by an ACL). It reads the servers' settings of the moment:
// call it at start-up, or in a readiness check.
func (s *RedisStore) CheckEviction(ctx context.Context) error {
	var mu sync.Mutex
	var unsafe []error
	check := func(ctx context.Context, c *redis.Client) error {
		info, err := c.InfoMap(ctx, "memory").Result()
		var re redis.Error
		switch {
		case errors.As(err, &re):
			err = fmt.Errorf("%s does not say whether it evicts: %w", c.Options().Addr, err)
		case err != nil:
			return storeerr.Unavailable("check eviction", err)
		default:
			err = evicts(c.Options().Addr, info["Memory"])
		}
		if err != nil {
			mu.Lock()
			unsafe = append(unsafe, err)
			mu.Unlock()
		}
		return nil
	}
	if err := s.eachServer(ctx, check); err != nil {
		return err
	}
	if len(unsafe) > 0 {
		return fmt.Errorf("idempotency: records may be lost to eviction: %w", errors.Join(unsafe...))
	}
	return nil
}

// evicts judges the memory section of a server's INFO: nil when the server
// keeps every key until it expires.
func evicts(addr string, memory map[string]string) error {
	limit, policy := memory["maxmemory"], memory["maxmemory_policy"]
	switch {
	case limit == "" || policy == "":
		return fmt.Errorf("%s does not say whether it evicts: no maxmemory or maxmemory_policy in its INFO", addr)
	case policy == "noeviction" || limit == "0":
		return nil
	}
	return fmt.Errorf("%s evicts under maxmemory %s bytes by maxmemory-policy %s; set it to noeviction", addr, limit, policy)
}

const (
	// SurvivalUnknown: a server would not say (it refuses CONFIG or INFO,
	// as managed services often do).
	SurvivalUnknown Survival = iota
	// SurvivesNothing: appendonly no. A restart keeps at most the last
	// RDB snapshot, without the records written since.
	SurvivesNothing
	// SurvivesProcessCrash: appendonly yes with appendfsync everysec (or
	// no): a restart after the server's process was killed keeps every
	// write; a power loss or an operating system's crash can lose about
	// the last second of them (with no, whatever the system had not yet
	// written out).
	SurvivesProcessCrash
	// SurvivesPowerLoss: every write the store was answered is on disk:
	// appendonly yes with appendfsync always. Not everysec, even with
	// RedisOptions.Fsync.Master, whose WAITAOF may answer there before
	// the fsync (see Fsync.Master).
	SurvivesPowerLoss
)

// ListAbandoned implements Store: one script per bucket, all in one pipeline,
// merged oldest lease first.
func (s *RedisStore) ListAbandoned(ctx context.Context, limit int) ([]AbandonedRecord, error) {
	if limit <= 0 {
		return nil, nil
	}
	// A pipeline cannot fall back to EVAL command by command.
	if err := s.c.ScriptLoad(ctx, s.scripts.abandoned.src).Err(); err != nil {
		return nil, storeerr.Unavailable("abandoned", err)
	}
	cmds, err := s.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for b := range s.buckets {
			_ = p.Process(ctx, redis.NewCmd(ctx, append(s.scripts.abandoned.args("1", 2), s.buckets[b].leases, limit)...))
		}
		return nil
	})
	if err != nil {
		return nil, storeerr.Unavailable("abandoned", err)
	}
	var all []dueRecord
	for b, cmd := range cmds {
		v, _ := cmd.(*redis.Cmd).Slice()
		tag := s.bucketTag(uint32(b))
		for i := 0; i+2 < len(v); i += 3 {
			rec, _ := v[i].(string)
			fp, _ := v[i+1].(string)
			deadline, err := strconv.ParseInt(fmt.Sprint(v[i+2]), 10, 64)
			k, ok := parseRecordName(strings.TrimPrefix(rec, tag))
			if !ok || err != nil || len(fp) != len(Fingerprint{}) || !strings.HasPrefix(rec, tag) {
				return nil, storeerr.Unavailable("abandoned", fmt.Errorf("unexpected entry %q in %sleases", rec, tag))
			}
			all = append(all, dueRecord{AbandonedRecord{Key: k, Fingerprint: Fingerprint([]byte(fp))}, deadline})
		}
	}
	return oldestFirst(all, limit), nil
}

// Inspect implements Inspector, in one script on the record's slot.
func (s *RedisStore) Inspect(ctx context.Context, k Key) (Record, error) {
	ks, _ := s.keysOf(k)
	v, err := s.scripts.inspect.run(ctx, s.c, append(s.scripts.inspect.args("2", 2), &ks.rec, &ks.points)).Slice()
	if err != nil {
		return Record{}, storeerr.Unavailable("inspect", err)
	}
	if len(v) != 4 || v[0] == nil {
		return Record{}, fmt.Errorf("%w of %v", ErrNoRecord, k)
	}
	value, _ := v[0].(string)
	ttl, _ := v[1].(int64)
	now, _ := v[2].(int64)
	points, _ := v[3].(string)
	r, err := inspected(k, value, points, ttl, now)
	if err != nil {
		return Record{}, fmt.Errorf("idempotency: the record of %v is not one this version writes: %w", k, err)
	}
	return r, nil
}

// inflightTies is how many records of one bucket may share the millisecond
// of a page's last lease end and still all be listed on the next page.
const inflightTies = 100

// ListInFlight implements Inspector: it reads the in-flight index of every
// bucket, from the cursor's lease end on, in one pipeline, as ListAbandoned
// does, and merges them.
func (s *RedisStore) ListInFlight(ctx context.Context, after string, limit int) ([]Record, string, error) {
	if limit <= 0 {
		return nil, after, nil
	}
	from := "-inf"
	if after != "" {
		end, _, err := ParsePageCursor(after)
		if err != nil {
			return nil, "", err
		}
		from = strconv.FormatInt(end, 10)
	}
	if err := s.c.ScriptLoad(ctx, s.scripts.inflight.src).Err(); err != nil {
		return nil, "", storeerr.Unavailable("inflight", err)
	}
	cmds, err := s.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for b := range s.buckets {
			// From the cursor's own lease end on, where the records that
			// share it sit before the cursor's: room for inflightTies.
			_ = p.Process(ctx, redis.NewCmd(ctx, append(s.scripts.inflight.args("1", 4), s.buckets[b].leases, from, limit+inflightTies, pointsSuffix)...))
		}
		return nil
	})
	if err != nil {
		return nil, "", storeerr.Unavailable("inflight", err)
	}
	var recs []Record
	ends := map[Key]int64{} // each record's lease end, by its own server's clock
	for b, cmd := range cmds {
		v, _ := cmd.(*redis.Cmd).Slice()
		tag := s.bucketTag(uint32(b))
		now, _ := v[0].(int64)
		for i := 1; i+3 < len(v); i += 4 {
			name, _ := v[i].(string)
			value, _ := v[i+1].(string)
			ttl, _ := v[i+2].(int64)
			points, _ := v[i+3].(string)
			k, ok := parseRecordName(strings.TrimPrefix(name, tag))
			if !ok || !strings.HasPrefix(name, tag) {
				return nil, "", storeerr.Unavailable("inflight", fmt.Errorf("unexpected entry %q in %sleases", name, tag))
			}
			r, err := inspected(k, value, points, ttl, now)
			if err != nil {
				return nil, "", fmt.Errorf("idempotency: the record of %v is not one this version writes: %w", k, err)
			}
			recs, ends[k] = append(recs, r), now+r.LeaseLeft.Milliseconds()
		}
	}
	return leasePage(recs, func(r Record) leaseCursor { return leaseCursor{ends[r.Key], r.Key} }, after, limit)
}

// fenced maps a script's FENCED reply to ErrFenced and any other failure to
// ErrUnavailable.
func fenced(op string, err error) error {
	var re redis.Error
	switch {
	case err == nil:
		return nil
	case errors.As(err, &re) && strings.HasPrefix(re.Error(), "FENCED"):
		return storeerr.Fenced(op)
	}
	return unavailable(op, err)
}
