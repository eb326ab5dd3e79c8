// The durability of the Redis store's writes: RedisOptions.Fsync, the waits for
// the append-only file, and CheckPersistence, which says what a restart of
// the servers keeps.

package idempotency

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idempotency-go/idempotency/internal/storeerr"
	"github.com/redis/go-redis/v9"
)

// Fsync is RedisOptions.Fsync: which servers must have written a change
// to their append-only file, and fsynced it, before the store counts it as
// made. The zero value asks for nothing.
//
// A master that cannot wait as asked is refused, by CheckPersistence and by
// the store's calls to it, with an error wrapping no ErrUnavailable that
// names it and the reason (appendonly no; appendfsync no or, with Master,
// everysec; a server without WAITAOF; an ACL that denies it). The refusal
// lasts only as long as its cause: a call after a back-off (100ms, doubling
// with each refusal in a row up to 2s) asks the master again, so that one
// set right (CONFIG SET appendonly yes) serves again within about 2s. A
// master found able is asked again every 10s, so that one switched to a
// setting it refuses is refused within that.
//
// A claim is refused before anything is written: the operation does not
// run. An owner's write (a completion, a release, a recovery point) is not:
// its operation may already have acted, and its outcome stored without the
// wait is worth more than none (a retry replays the true answer rather
// than take the record over after its lease and run it again). It is sent
// without the WAITAOF, or finds WAITAOF refused after it (appendonly
// switched off while the operation ran), and fails with an error wrapping
// ErrUnavailable that says the change is stored on the master but not
// fsynced, so that a power loss of its machine can still undo it.
type Fsync struct {
	// Master asks the record's master for it: a power loss or a crash of its
	// machine then keeps the change once it restarts. The master needs
	// appendonly yes with appendfsync always, which fsyncs every write
	// before answering it, so that the wait ends at once. appendfsync
	// everysec is refused: there Valkey 8.0 (and Redis before
	// redis/redis#13793) may answer WAITAOF for its own file without an
	// fsync, when less than a second passed since the last one, so what it
	// confirmed may be lost on a power loss.
	Master bool
	// Replicas asks that many of the master's replicas for it; they need
	// appendonly yes too, or they never confirm, and appendfsync always to
	// keep what they confirmed through a power loss (the store does not
	// ask them: CheckPersistence shows their settings).
	Replicas int
	// Timeout bounds each wait; default 1s. With RedisOptions.Replicas
	// also set, both waits follow the scripts, and the two timeouts
	// together must be below the client's ReadTimeout.
	Timeout time.Duration
}

// on reports whether f asks for anything.
func (f Fsync) on() bool { return f.Master || f.Replicas > 0 }

// local is WAITAOF's numlocal for f.
func (f Fsync) local() int {
	if f.Master {
		return 1
	}
	return 0
}

// confirmedNode is, with RedisOptions.Replicas or Fsync set, what the store
// keeps for one master: the batcher that sends scripts with WAIT and
// WAITAOF on it, and, with Fsync, what the master last answered when asked
// whether it can wait for its append-only file (fsyncReady).
type confirmedNode struct {
	// batch is set when the confirmedNode is made and never changed.
	batch *batcher
	// probing is a lock of one slot, held by the one call that asks the
	// master (fsyncReady); a channel, so that a call waiting for it still
	// ends with its context.
	probing chan struct{}
	// verdict is the master's latest fsyncVerdict, nil until the first
	// probe answers. It is replaced, never changed in place: by the holder
	// of probing, and by refuse (a compare-and-swap) when a WAITAOF is
	// refused; anyone reads it without a lock.
	verdict atomic.Pointer[fsyncVerdict]
}

// fsyncVerdict is what a master answered when asked whether it can wait
// for its append-only file; immutable once stored.
type fsyncVerdict struct {
	// err is nil when the master can, and wraps errCannotFsync when not.
	err error
	// next is when a call may ask the master again: after a refusal, the
	// end of its back-off; after an acceptance, the next check.
	next time.Time
	// backoff is, after a refusal, the wait that set next: it doubles with
	// each refusal in a row, up to fsyncSchedule.max.
	backoff time.Duration
}

// fsyncSchedule is when a store asks a master again whether it can wait
// for its append-only file. A RedisStore's is set by NewRedisStore and only
// read after.
type fsyncSchedule struct {
	// first is the back-off after a refusal that follows none, doubled by
	// each refusal in a row up to max.
	first, max time.Duration
	// recheck is the wait before a master found able is asked again.
	recheck time.Duration
}

// defaultFsyncSchedule is the schedule of every store: a master set right
// serves again within max, and one switched to a setting it refuses is
// refused within recheck.
func defaultFsyncSchedule() fsyncSchedule {
	return fsyncSchedule{first: 100 * time.Millisecond, max: 2 * time.Second, recheck: 10 * time.Second}
}

// refuse records that cn's master cannot wait for its append-only file,
// with err, wrapping errCannotFsync, and returns the refusal in force: err,
// or one already recorded whose back-off has not ended, so that the
// replies of one pipeline lengthen the back-off once.
func (cn *confirmedNode) refuse(err error, sch fsyncSchedule) error {
	for {
		now, old := time.Now(), cn.verdict.Load()
		backoff := sch.first
		if old != nil && old.err != nil {
			if now.Before(old.next) {
				return old.err
			}
			backoff = min(2*old.backoff, sch.max)
		}
		if cn.verdict.CompareAndSwap(old, &fsyncVerdict{err: err, next: now.Add(backoff), backoff: backoff}) {
			return err
		}
	}
}

// lockProbe takes cn.probing: with wait, until ctx ends, and otherwise
// only if no other call holds it. It reports whether it did.
func (cn *confirmedNode) lockProbe(ctx context.Context, wait bool) bool {
	if !wait {
		select {
		case cn.probing <- struct{}{}:
			return true
		default:
			return false
		}
	}
	select {
	case cn.probing <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

// confirmedNode returns the confirmedNode of node, a master: one per
// master, since WAIT and WAITAOF cover only the writes of their own
// connection.
func (s *RedisStore) confirmedNode(node *redis.Client) *confirmedNode {
	if cn, ok := s.confirmed.Load(node); ok {
		return cn.(*confirmedNode)
	}
	cn, _ := s.confirmed.LoadOrStore(node, &confirmedNode{batch: &batcher{send: s.sendConfirmed(node, true)}, probing: make(chan struct{}, 1)})
	return cn.(*confirmedNode)
}

// errCannotFsync: a master cannot wait for its append-only file as
// RedisOptions.Fsync asks. A claim on it fails with this error, not
// ErrUnavailable: the master answers, but running the operation unguarded
// (Options.FailOpen) is not what a durability setting asks for.
var errCannotFsync = errors.New("idempotency: RedisOptions.Fsync cannot be met")

// errNotFsynced: an owner's write was stored on its master, but not
// fsynced as RedisOptions.Fsync asks, since the master cannot wait.
var errNotFsynced = errors.New("idempotency: stored on the master, but not fsynced, so a power loss of its machine can undo it")

// fsyncReady returns nil when node, a master, can wait for its append-only
// file as RedisOptions.Fsync asks (or Fsync is not set), and an error
// wrapping errCannotFsync when it cannot, by its latest verdict. The first
// call to node asks it, before anything is written (probeFsync), and the
// calls that come meanwhile wait for its answer. Once that verdict is due
// (see fsyncSchedule), one call asks again while the others keep to it. A
// first probe that fails (a network error) is the failure of its call; a
// later one leaves the verdict due, for the next call to ask again.
func (s *RedisStore) fsyncReady(ctx context.Context, node *redis.Client, cn *confirmedNode) error {
	if !s.fsync.on() {
		return nil
	}
	v := cn.verdict.Load()
	if v != nil && time.Now().Before(v.next) {
		return v.err
	}
	if !cn.lockProbe(ctx, v == nil) {
		if v != nil {
			return v.err
		}
		return fmt.Errorf("idempotency: the call's context ended %s: %w", unsent, ctx.Err())
	}
	defer func() { <-cn.probing }()
	if now := cn.verdict.Load(); now != v {
		return now.err // another call asked meanwhile
	}
	refused, err := s.probeFsync(ctx, node)
	switch {
	case err != nil && v != nil && v.err == nil:
		return nil // the master could a moment ago; the scripts' WAITAOF still judges
	case err != nil:
		return fmt.Errorf("asking %s whether it can wait for its append-only file: %w", node.Options().Addr, err)
	case refused != nil:
		return cn.refuse(refused, s.fsyncSchedule)
	}
	cn.verdict.Store(&fsyncVerdict{next: time.Now().Add(s.fsyncSchedule.recheck)})
	return nil
}

// probeFsync asks node, a master, whether it can wait for its append-only
// file as RedisOptions.Fsync asks, writing nothing: WAITAOF on a
// connection that has written nothing returns at once, or refuses (an
// unknown command, appendonly no), and, for Fsync.Master, CONFIG GET
// appendfsync, where "no" means that the server never fsyncs on its own,
// so that the wait could only time out, and "everysec" that WAITAOF may
// answer before the fsync (see Fsync.Master). A server that refuses CONFIG
// is taken at its WAITAOF's word. refused wraps errCannotFsync; err is a
// failure to ask.
func (s *RedisStore) probeFsync(ctx context.Context, node *redis.Client) (refused, err error) {
	var waitaof *redis.Cmd
	var config *redis.MapStringStringCmd
	// The pipeline's error is its first command's that failed: the
	// WAITAOF's, judged below, or a refused CONFIG's, which tells nothing.
	_, _ = node.Pipelined(ctx, func(p redis.Pipeliner) error {
		// 1 ms: the connection may have written before (it is the pool's),
		// and its writes be on their way to the disk.
		waitaof = p.Do(ctx, "WAITAOF", s.fsync.local(), 0, 1)
		if s.fsync.Master {
			config = p.ConfigGet(ctx, "appendfsync")
		}
		return nil
	})
	if err := waitaof.Err(); err != nil {
		if refused := s.fsyncRefusal(node, err); refused != nil {
			return refused, nil
		}
		return nil, err
	}
	if config == nil {
		return nil, nil
	}
	switch config.Val()["appendfsync"] {
	case "no":
		return fmt.Errorf("%w: %s has appendfsync no, so it never fsyncs its append-only file on its own and WAITAOF could only time out: set appendfsync always",
			errCannotFsync, node.Options().Addr), nil
	case "everysec":
		return fmt.Errorf("%w: %s has appendfsync everysec, where WAITAOF may answer before the fsync (Valkey 8.0, Redis before redis/redis#13793), so a power loss can lose about the last second of what it confirmed: set appendfsync always",
			errCannotFsync, node.Options().Addr), nil
	}
	return nil, nil
}

// fsyncRefusal returns, wrapping errCannotFsync, what err, node's reply to
// WAITAOF, says when it means that node cannot wait for its append-only
// file whatever the store does: a server without WAITAOF, one with
// appendonly no, or an ACL that denies WAITAOF. Other errors, such as a
// lost connection or a master turned replica, are not: nil.
func (s *RedisStore) fsyncRefusal(node *redis.Client, err error) error {
	var reply redis.Error
	if !errors.As(err, &reply) {
		return nil
	}
	msg := reply.Error()
	addr := node.Options().Addr
	switch {
	case strings.HasPrefix(msg, "ERR unknown command"):
		return fmt.Errorf("%w: %s has no WAITAOF, which needs Redis 7.2 or later, or Valkey: %w", errCannotFsync, addr, err)
	case strings.Contains(msg, "appendonly is disabled"):
		return fmt.Errorf("%w: %s has appendonly no: set appendonly yes: %w", errCannotFsync, addr, err)
	case strings.HasPrefix(msg, "NOPERM"):
		return fmt.Errorf("%w: %s denies WAITAOF to this user: %w", errCannotFsync, addr, err)
	}
	return nil
}

// ErrNoPersistence: a Redis server keeps nothing across a restart
// (appendonly no): a restart loses every record written since its last
// snapshot, if it takes any, and a retry of one of them runs its operation
// again, as attempt 1 under a new operation ID (see
// RedisStore.CheckPersistence). A service that accepts a second charge
// after a restart of its Redis says so by letting
// errors.Is(err, ErrNoPersistence) pass.
var ErrNoPersistence = errors.New("idempotency: a restart of the Redis server loses the records")

// Survival is what a restart of a Redis server keeps of the writes it
// answered, from the least to the most; SurvivalUnknown when the server
// will not say.
type Survival int

func (v Survival) String() string {
	switch v {
	case SurvivesNothing:
		return "a restart keeps nothing"
	case SurvivesProcessCrash:
		return "a restart keeps what was answered through a process crash, not a power loss"
	case SurvivesPowerLoss:
		return "a restart keeps what was answered, even through a power loss"
	}
	return "cannot tell what a restart keeps"
}

// Persistence is what a restart of the store's servers keeps, as
// RedisStore.CheckPersistence reads it from their settings.
type Persistence struct {
	// Survives is the least any server keeps, SurvivalUnknown when one
	// would not say and none keeps nothing.
	Survives Survival
	// Reason gives each server's address and settings ("127.0.0.1:6379:
	// appendonly yes, appendfsync everysec"), or why it would not say.
	Reason string
}

func (p Persistence) String() string {
	return fmt.Sprintf("%v (%s)", p.Survives, p.Reason)
}

// CheckPersistence reports what a restart of the servers keeps of the
// records, by their settings of the moment: a record a restart loses is an
// operation run again by its retry, as attempt 1, under a new operation ID
// and with tokens starting over from lower numbers, so neither
// DownstreamKey nor a database fencing on tokens can catch the repeat.
//
// It asks the servers as CheckEviction does (on a cluster every node,
// replicas too, each judged by its own settings since a failover promotes
// one), with INFO persistence and CONFIG GET appendfsync. It returns the
// answer, and an error: wrapping ErrNoPersistence when a server keeps
// nothing (appendonly no), which a service that accepts a second charge
// after a restart lets pass; wrapping ErrUnavailable when a server cannot
// be reached; naming the master when RedisOptions.Fsync asks for what it
// cannot do (appendonly no, appendfsync no or, with Fsync.Master,
// everysec, no WAITAOF). A server that
// refuses CONFIG or INFO, as managed services do, is SurvivalUnknown, with
// the reason, and no error. Call it at start-up, beside CheckEviction.
func (s *RedisStore) CheckPersistence(ctx context.Context) (Persistence, error) {
	var mu sync.Mutex
	var answers []persisted
	var refused []error
	check := func(ctx context.Context, c *redis.Client) error {
		a, err := s.persistence(ctx, c)
		if err != nil {
			return storeerr.Unavailable("check persistence", err)
		}
		var cannot error
		if s.fsync.on() && a.master {
			if cannot, err = s.probeFsync(ctx, c); err != nil {
				return storeerr.Unavailable("check persistence", err)
			}
		}
		mu.Lock()
		defer mu.Unlock()
		answers = append(answers, a)
		if cannot != nil {
			refused = append(refused, cannot)
		}
		return nil
	}
	if err := s.eachServer(ctx, check); err != nil {
		return Persistence{}, err
	}
	slices.SortFunc(answers, func(a, b persisted) int { return strings.Compare(a.addr, b.addr) })
	p := Persistence{Survives: SurvivesPowerLoss}
	var reasons, none []string
	unknown := false
	for _, a := range answers {
		reasons = append(reasons, a.addr+": "+a.why)
		switch a.survives {
		case SurvivesNothing:
			none = append(none, a.addr+": "+a.why)
		case SurvivalUnknown:
			unknown = true
		default:
			p.Survives = min(p.Survives, a.survives)
		}
	}
	p.Reason = strings.Join(reasons, "; ")
	switch {
	case len(none) > 0:
		p.Survives = SurvivesNothing
	case unknown:
		p.Survives = SurvivalUnknown
	}
	if len(refused) > 0 {
		return p, errors.Join(refused...)
	}
	if len(none) > 0 {
		return p, fmt.Errorf("%w: %s", ErrNoPersistence, strings.Join(none, "; "))
	}
	return p, nil
}

// persisted is what CheckPersistence read from one server.
type persisted struct {
	addr     string
	master   bool
	survives Survival
	why      string
}

// persistence reads what a restart of c's server keeps. err is a failure to
// ask; a server that refuses to say is SurvivalUnknown.
func (s *RedisStore) persistence(ctx context.Context, c *redis.Client) (persisted, error) {
	a := persisted{addr: c.Options().Addr}
	info, err := c.InfoMap(ctx, "persistence", "replication").Result()
	var re redis.Error
	switch {
	case errors.As(err, &re):
		a.why = "cannot tell: INFO refused: " + err.Error()
		return a, nil
	case err != nil:
		return a, err
	}
	role, aof := info["Replication"]["role"], info["Persistence"]["aof_enabled"]
	a.master = role == "master"
	switch aof {
	case "0":
		a.survives, a.why = SurvivesNothing, "appendonly no"
		return a, nil
	case "1":
	default:
		a.why = "cannot tell: no aof_enabled in its INFO"
		return a, nil
	}
	fsync, err := c.ConfigGet(ctx, "appendfsync").Result()
	switch {
	case errors.As(err, &re):
		a.why = "appendonly yes, but cannot tell its appendfsync: CONFIG GET refused: " + err.Error()
		return a, nil
	case err != nil:
		return a, err
	}
	a.why = "appendonly yes, appendfsync " + fsync["appendfsync"]
	switch fsync["appendfsync"] {
	case "always":
		a.survives = SurvivesPowerLoss
	case "everysec":
		// Not with Fsync.Master either: WAITAOF may answer before the
		// fsync there (see Fsync.Master), and the probe refuses it.
		a.survives, a.why = SurvivesProcessCrash, a.why+" (a power loss can lose about the last second"
		if s.fsync.Master && a.master {
			a.why += "; RedisOptions.Fsync.Master needs appendfsync always"
		}
		a.why += ")"
	case "no":
		a.survives = SurvivesProcessCrash
	default:
		a.survives, a.why = SurvivalUnknown, "cannot tell: "+a.why
	}
	return a, nil
}
