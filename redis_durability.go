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
type Fsync struct {
	// Master asks the record's master for it: a power loss or a crash of its
	// machine then keeps the change once it restarts. The master needs
	// appendonly yes, with appendfsync everysec or always. With everysec
	// the wait ends at the server's next fsync, on Valkey 8 within about
	// one tick of its cron, 1/hz s (0.1 s at the default hz 10), shared by
	// every write of that tick. With always, which already fsyncs every
	// write before answering it, the wait ends at once.
	Master bool
	// Replicas asks that many of the master's replicas for it; they need
	// appendonly yes too, or they never confirm.
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
// WAITAOF on it, and, with Fsync, whether it can wait for its append-only
// file, which the first call to it finds out (fsyncReady).
type confirmedNode struct {
	batch *batcher
	// probing is a lock of one slot, held while a call probes the master;
	// a channel, so that a call waiting for it still ends with its context.
	probing chan struct{}
	// probed is set once the probe answered: its error, or nil, the master
	// can.
	probed atomic.Pointer[error]
}

// refuse marks cn's master as one that cannot wait for its append-only
// file, with err: calls to it fail at once.
func (cn *confirmedNode) refuse(err error) { cn.probed.Store(&err) }

// confirmedNode returns the confirmedNode of node, a master: one per
// master, since WAIT and WAITAOF cover only the writes of their own
// connection.
func (s *RedisStore) confirmedNode(node *redis.Client) *confirmedNode {
	if cn, ok := s.confirmed.Load(node); ok {
		return cn.(*confirmedNode)
	}
	cn, _ := s.confirmed.LoadOrStore(node, &confirmedNode{batch: &batcher{send: s.sendConfirmed(node)}, probing: make(chan struct{}, 1)})
	return cn.(*confirmedNode)
}

// errCannotFsync: a master cannot wait for its append-only file as
// RedisOptions.Fsync asks. The store sends it nothing more; a call to it
// fails with this error, not ErrUnavailable, since no retry or fail-open
// can help.
var errCannotFsync = errors.New("idempotency: RedisOptions.Fsync cannot be met")

// fsyncReady returns nil when node, a master, can wait for its append-only
// file as RedisOptions.Fsync asks (or Fsync is not set), and an error
// wrapping errCannotFsync when it cannot. The first call to node finds out,
// before anything is written (probeFsync), and the others wait for its
// answer; a probe that fails (a network error) is the failure of its call,
// and the next call probes again.
func (s *RedisStore) fsyncReady(ctx context.Context, node *redis.Client, cn *confirmedNode) error {
	if !s.fsync.on() {
		return nil
	}
	if p := cn.probed.Load(); p != nil {
		return *p
	}
	select {
	case cn.probing <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("idempotency: the call's context ended %s: %w", unsent, ctx.Err())
	}
	defer func() { <-cn.probing }()
	if p := cn.probed.Load(); p != nil {
		return *p
	}
	refused, err := s.probeFsync(ctx, node)
	if err != nil {
		return fmt.Errorf("asking %s whether it can wait for its append-only file: %w", node.Options().Addr, err)
	}
	cn.probed.Store(&refused)
	return refused
}

// probeFsync asks node, a master, whether it can wait for its append-only
// file as RedisOptions.Fsync asks, writing nothing: WAITAOF on a
// connection that has written nothing returns at once, or refuses (an
// unknown command, appendonly no), and, for Fsync.Master, CONFIG GET
// appendfsync, where "no" means that the server never fsyncs on its own,
// so that the wait could only time out. A server that refuses CONFIG is
// taken at its WAITAOF's word. refused wraps errCannotFsync; err is a
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
	if config != nil && config.Val()["appendfsync"] == "no" {
		return fmt.Errorf("%w: %s has appendfsync no, so it never fsyncs its append-only file on its own and WAITAOF could only time out: set appendfsync everysec or always",
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
// cannot do (appendonly no, appendfsync no, no WAITAOF). A server that
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
	case "everysec", "no":
		a.survives = SurvivesProcessCrash
		if s.fsync.Master && a.master && fsync["appendfsync"] == "everysec" {
			a.survives, a.why = SurvivesPowerLoss, a.why+", with RedisOptions.Fsync.Master"
		}
	default:
		a.survives, a.why = SurvivalUnknown, "cannot tell: "+a.why
	}
	return a, nil
}
