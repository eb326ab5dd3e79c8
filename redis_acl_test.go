package idempotency_test

import (
	"context"
	"crypto/rand"
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
	"github.com/idempotency-go/idempotency/internal/testkit/statstest"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// securityDoc is the page whose "Least privilege: Redis" section holds the
// runtime user's ACL: the lines this test creates the user with are read
// from it, so the page and the test cannot disagree.
const securityDoc = "docs/security.md"

// aclUser is the user every ACL line of the page sets up.
const aclUser = "idempotency"

// aclRules are the ACL SETUSER lines of the page's Redis section, by what
// they are for. base is the one every deployment needs; each other adds the
// commands of one option or deployment.
type aclRules struct {
	base, identity, config, wait, waitaof, cluster string
}

// docACL reads the ACL SETUSER lines of the page's Redis section and sorts
// them by the command that tells each apart. Every line must be one of the
// six, so that none of the page goes untested.
func docACL(t *testing.T) aclRules {
	t.Helper()
	b, err := os.ReadFile(securityDoc)
	require.NoError(t, err)
	_, section, ok := strings.Cut(string(b), "\n## Least privilege: Redis\n")
	require.True(t, ok, "%s has no section \"Least privilege: Redis\"", securityDoc)
	section, _, _ = strings.Cut(section, "\n## ")
	var r aclRules
	slots := map[string]*string{"reset": &r.base, "+client|setinfo": &r.identity, "+config|get": &r.config, "+wait": &r.wait, "+waitaof": &r.waitaof, "+spublish": &r.cluster}
	for line := range strings.Lines(section) {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, "ACL SETUSER "+aclUser+" ") {
			continue
		}
		var slot *string
		for _, f := range strings.Fields(line) {
			if s := slots[f]; s != nil && slot == nil {
				slot = s
			}
		}
		require.NotNil(t, slot, "%s: an ACL line this test does not know: %s", securityDoc, line)
		require.Empty(t, *slot, "%s: two ACL lines for one purpose: %s", securityDoc, line)
		*slot = line
	}
	for name, s := range slots {
		require.NotEmpty(t, *s, "%s: no ACL line with %s", securityDoc, name)
	}
	return r
}

// grants lists the commands line allows, as INFO commandstats names them.
func grants(line string) []string {
	var cmds []string
	for _, f := range strings.Fields(line) {
		if c, ok := strings.CutPrefix(f, "+"); ok {
			cmds = append(cmds, c)
		}
	}
	return cmds
}

// setUser runs line on c, with password in place of the page's CHANGE-ME.
func setUser(ctx context.Context, c *redis.Client, line, password string) error {
	line = strings.Replace(line, ">CHANGE-ME", ">"+password, 1)
	var args []any
	for _, f := range strings.Fields(line) {
		args = append(args, f)
	}
	return c.Do(ctx, args...).Err()
}

// newPassword is a password no test shares.
func newPassword() string { return rand.Text() }

// commandsRun adds to seen the commands c's server ran since its statistics
// were reset, scripts' own commands included.
func commandsRun(t *testing.T, ctx context.Context, c *redis.Client, seen map[string]bool) {
	t.Helper()
	info, err := c.Info(ctx, "commandstats").Result()
	require.NoError(t, err)
	for line := range strings.Lines(info) {
		if name, _, ok := strings.Cut(strings.TrimPrefix(line, "cmdstat_"), ":calls="); ok && strings.HasPrefix(line, "cmdstat_") {
			seen[name] = true
		}
	}
}

// noDenials fails t if c's server refused anything to anyone since its ACL
// log was reset.
func noDenials(t *testing.T, ctx context.Context, c *redis.Client) {
	t.Helper()
	log, err := c.ACLLog(ctx, 100).Result()
	require.NoError(t, err)
	for _, e := range log {
		t.Errorf("%s: the ACL refused %s %q (%s) to %s: a command the store sends is missing from %s",
			c.Options().Addr, e.Reason, e.Object, e.Context, e.Username, securityDoc)
	}
}

// resetStats clears c's server's command statistics and ACL log, so that
// what they show next is the store's doing.
func resetStats(t *testing.T, ctx context.Context, c *redis.Client) {
	t.Helper()
	require.NoError(t, c.ConfigResetStat(ctx).Err())
	require.NoError(t, c.Do(ctx, "ACL", "LOG", "RESET").Err())
}

// TestRedisLeastPrivilege creates the runtime user with exactly the ACL
// lines of docs/security.md, on a standalone server and on a Cluster, and
// runs everything the store does as that user: the conformance suite,
// Stats, CheckEviction and CheckPersistence, with Replicas, and with Fsync
// where the server has WAITAOF. Nothing may be refused (ACL LOG stays
// empty), and every command the lines grant must have been run on one of
// the two (INFO commandstats): the lines are what the store needs, no
// less and no more.
func TestRedisLeastPrivilege(t *testing.T) {
	t.Parallel() // servers of its own: runs beside the other long suites
	rules := docACL(t)
	seen := map[string]bool{}
	exempt := map[string]bool{} // granted, but by a line this server refuses
	t.Run("Standalone", func(t *testing.T) { aclStandalone(t, rules, seen, exempt) })
	t.Run("Cluster", func(t *testing.T) { aclCluster(t, rules, seen, exempt) })
	if t.Failed() {
		return
	}
	for _, line := range []string{rules.base, rules.identity, rules.config, rules.wait, rules.waitaof, rules.cluster} {
		for _, cmd := range grants(line) {
			if !seen[cmd] && !exempt[cmd] {
				t.Errorf("%s grants %s, which the store never sent: %s", securityDoc, cmd, line)
			}
		}
	}
}

// aclStandalone runs the store as the user on a master with a replica.
func aclStandalone(t *testing.T, rules aclRules, seen, exempt map[string]bool) {
	ctx := context.Background()
	master := testserver.StartRedis(t, "--appendonly", "yes", "--appendfsync", "always")
	testserver.StartRedis(t, "--replicaof", "127.0.0.1", strconv.Itoa(master.Port))
	admin := master.Client()
	waitForReplica(t, ctx, admin)
	password := newPassword()
	for _, line := range []string{rules.base, rules.config, rules.wait} {
		require.NoError(t, setUser(ctx, admin, line, password), line)
	}
	o := idempotency.RedisOptions{Replicas: 1, ReplicaTimeout: 2 * time.Second}
	setUserIfKnown(t, ctx, admin, rules.identity, password, exempt)
	if setUserIfKnown(t, ctx, admin, rules.waitaof, password, exempt) {
		o.Fsync = idempotency.Fsync{Master: true, Timeout: 2 * time.Second}
	}
	resetStats(t, ctx, admin)
	c := redis.NewClient(&redis.Options{Addr: master.Addr, Username: aclUser, Password: password, ReadTimeout: 10 * time.Second})
	t.Cleanup(func() { c.Close() })
	// The operator command's start-up check; the waiters' connection
	// pings too, but only after 3 s of silence.
	require.NoError(t, c.Ping(ctx).Err())
	s, err := idempotency.NewRedisStore(c, o)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	runAsUser(t, ctx, s, func() { require.NoError(t, admin.FlushAll(ctx).Err()) })
	p, err := s.CheckPersistence(ctx)
	require.NoError(t, err)
	assert.Equal(t, idempotency.SurvivesPowerLoss, p.Survives, "CheckPersistence as the user: %s", p.Reason)
	noDenials(t, ctx, admin)
	commandsRun(t, ctx, admin, seen)
	refusesOthers(t, ctx, c, admin)
}

// setUserIfKnown runs line, which grants one command, on c when c's server
// knows the command, and reports whether it did. A server that does not
// must refuse the line; the command is then exempt from having been seen.
func setUserIfKnown(t *testing.T, ctx context.Context, c *redis.Client, line, password string, exempt map[string]bool) bool {
	t.Helper()
	cmds := grants(line)
	require.Len(t, cmds, 1, "%s: a line for a command some servers lack grants it alone: %s", securityDoc, line)
	if hasCommand(t, ctx, c, cmds[0]) {
		require.NoError(t, setUser(ctx, c, line, password), line)
		return true
	}
	require.Error(t, setUser(ctx, c, line, password), "a server without %s refuses the line that grants it", cmds[0])
	exempt[cmds[0]] = true
	return false
}

// runAsUser runs, on s, Stats's own check, then (after flush, which empties
// the server of its records) the conformance suite, Stats and
// CheckEviction: what a service and an operator do.
func runAsUser(t *testing.T, ctx context.Context, s *idempotency.RedisStore, flush func()) {
	t.Helper()
	t.Run("Stats", func(t *testing.T) { statstest.Check(t, s) })
	flush()
	t.Run("Conformance", func(t *testing.T) {
		idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness { return idempotencytest.Harness{Store: s} })
	})
	_, err := s.Stats(ctx)
	require.NoError(t, err)
	require.NoError(t, s.CheckEviction(ctx), "CheckEviction as the user")
}

// waitForReplica waits until the master counts its replica in WAIT, which
// it does from the replica's first acknowledgement on.
func waitForReplica(t *testing.T, ctx context.Context, master *redis.Client) {
	t.Helper()
	conn := master.Conn()
	defer conn.Close()
	require.Eventually(t, func() bool {
		return conn.Incr(ctx, "ready").Err() == nil && conn.Wait(ctx, 1, 100*time.Millisecond).Val() == 1
	}, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, conn.Del(ctx, "ready").Err())
}

// hasCommand reports whether c's server knows the command name, or the
// subcommand container|name.
func hasCommand(t *testing.T, ctx context.Context, c *redis.Client, name string) bool {
	t.Helper()
	info, err := c.Do(ctx, "COMMAND", "INFO", name).Slice()
	require.NoError(t, err)
	return len(info) == 1 && info[0] != nil
}

// aclCluster runs the store as the user on a Cluster of three masters,
// each given the user by the base and the Cluster lines.
func aclCluster(t *testing.T, rules aclRules, seen, exempt map[string]bool) {
	ctx := context.Background()
	cl := testserver.StartCluster(t, 3, 0)
	password := newPassword()
	var admins []*redis.Client
	for _, node := range cl.Nodes {
		admin := node.Client()
		for _, line := range []string{rules.base, rules.cluster} {
			require.NoError(t, setUser(ctx, admin, line, password), "%s: %s", node.Addr, line)
		}
		setUserIfKnown(t, ctx, admin, rules.identity, password, exempt)
		resetStats(t, ctx, admin)
		admins = append(admins, admin)
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs, Username: aclUser, Password: password})
	t.Cleanup(func() { cc.Close() })
	s, err := idempotency.NewRedisStore(cc, idempotency.RedisOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	runAsUser(t, ctx, s, func() {
		for _, admin := range admins {
			// A replica refuses the write; there is none here.
			require.NoError(t, admin.FlushAll(ctx).Err())
		}
	})
	// These nodes keep nothing across a restart; without CONFIG GET the
	// check still reads that from INFO.
	p, err := s.CheckPersistence(ctx)
	require.ErrorIs(t, err, idempotency.ErrNoPersistence)
	assert.Equal(t, idempotency.SurvivesNothing, p.Survives, p.Reason)
	for _, admin := range admins {
		noDenials(t, ctx, admin)
		commandsRun(t, ctx, admin, seen)
	}
}

// refusesOthers checks that the user c logs in as is held to the ACL: no
// key, channel or command outside it, inside a script neither, where Redis
// checks a script's keys whether or not it declared them in KEYS. admin's
// view of the server's ACL log then shows the refusals, as noDenials
// expects.
func refusesOthers(t *testing.T, ctx context.Context, c, admin *redis.Client) {
	t.Helper()
	denied := func(err error, what string) {
		t.Helper()
		var re redis.Error
		if assert.True(t, errors.As(err, &re), "%s: want a refusal, got %v", what, err) {
			msg := strings.ToLower(re.Error())
			assert.True(t, strings.Contains(msg, "permission") || strings.Contains(msg, "access"), "%s: %v", what, err)
		}
	}
	denied(c.Get(ctx, "other").Err(), "GET of a key outside the prefix")
	denied(c.Keys(ctx, "*").Err(), "KEYS")
	denied(c.FlushAll(ctx).Err(), "FLUSHALL")
	denied(c.ConfigSet(ctx, "maxmemory-policy", "allkeys-lru").Err(), "CONFIG SET")
	get := "return redis.call('GET', ARGV[1])"
	require.ErrorIs(t, c.Eval(ctx, get, nil, "idem:undeclared").Err(), redis.Nil, "a script's GET of an undeclared key in the prefix")
	denied(c.Eval(ctx, get, nil, "other").Err(), "a script's GET of an undeclared key outside the prefix")
	denied(c.Publish(ctx, "other", "x").Err(), "PUBLISH outside the prefix")
	ps := c.Subscribe(ctx, "other")
	defer ps.Close()
	_, err := ps.Receive(ctx)
	denied(err, "SUBSCRIBE outside the prefix")
	log, err := admin.ACLLog(ctx, 100).Result()
	require.NoError(t, err)
	assert.NotEmpty(t, log, "the refusals are in the ACL log")
}
