package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/postgres"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// storeConfig says which store to open: exactly one of Redis (standalone,
// Sentinel or Cluster) and PostgreSQL.
type storeConfig struct {
	redisURL, cluster, sentinel, prefix string
	redisTLS                            redisTLS
	postgresDSN, table                  string
	// noMigrate keeps the proxy from running Migrate: a runtime role
	// without the table's ownership may not (docs/security.md).
	noMigrate bool
}

// redisTLS is how the command reaches Redis over TLS: -redis takes it from
// a rediss:// URL, -redis-cluster and -sentinel from -redis-tls or any of
// the files.
type redisTLS struct {
	on             bool
	ca, cert, keyf string // PEM files
}

func (c *storeConfig) flags(fs *flag.FlagSet) {
	fs.StringVar(&c.redisURL, "redis", "", "a standalone Redis, `URL` redis://[user:password@]host:port[/db] (rediss:// for TLS)")
	fs.StringVar(&c.cluster, "redis-cluster", "", "a Redis Cluster, by its nodes' `ADDRS`, host:port,...")
	fs.StringVar(&c.sentinel, "sentinel", "", "a Redis behind Sentinel, `MASTER@ADDRS`: the master's name and the sentinels' host:port,...")
	fs.StringVar(&c.prefix, "redis-prefix", "", "the service's RedisOptions.Prefix (default idem:)")
	fs.BoolVar(&c.redisTLS.on, "redis-tls", false, "reach -redis-cluster or -sentinel over TLS (for -redis, use rediss://)")
	fs.StringVar(&c.redisTLS.ca, "redis-ca", "", "trust the CA certificates in `FILE` (PEM) for Redis's TLS, instead of the system's")
	fs.StringVar(&c.redisTLS.cert, "redis-cert", "", "present the client certificate in `FILE` (PEM) to Redis, with -redis-key")
	fs.StringVar(&c.redisTLS.keyf, "redis-key", "", "the client certificate's key, `FILE` (PEM)")
	fs.StringVar(&c.postgresDSN, "postgres", "", "a PostgreSQL `DSN`")
	fs.StringVar(&c.table, "table", "", "the service's postgres.Options.Table (default idempotency_records)")
	fs.BoolVar(&c.noMigrate, "no-migrate", false, "proxy: do not run Migrate on the PostgreSQL table at start-up, but require it migrated (for a role that does not own it)")
}

// opened is a store, as the library uses it and as an operator inspects it.
type opened struct {
	store     idempotency.Store
	inspector idempotency.Inspector
	stats     func(context.Context) (idempotency.Stats, error)
	// deleteExpired deletes the records past their retention, on a store
	// that does not on its own (PostgreSQL); nil otherwise.
	deleteExpired func(context.Context) (int64, error)
}

// open opens the store the flags name, and checks that it is one of this
// library's.
func (c *storeConfig) open(ctx context.Context) (opened, func(), error) {
	return c.openFor(ctx, false)
}

// openToServe opens the store the flags name for a service that runs
// operations on it: a PostgreSQL table is made or brought up to date
// (Migrate), unless -no-migrate, and a Redis that may evict records is refused unless
// allowEviction.
func (c *storeConfig) openToServe(ctx context.Context, allowEviction bool) (opened, func(), error) {
	s, closeStore, err := c.openFor(ctx, !c.noMigrate)
	if err != nil || c.postgresDSN != "" || allowEviction {
		return s, closeStore, err
	}
	if err := s.store.(*idempotency.RedisStore).CheckEviction(ctx); err != nil {
		closeStore()
		return opened{}, nil, fmt.Errorf("%w (-allow-eviction serves anyway)", err)
	}
	return s, closeStore, nil
}

// openFor opens the store the flags name; migrate makes or updates a
// PostgreSQL table instead of requiring one.
func (c *storeConfig) openFor(ctx context.Context, migrate bool) (opened, func(), error) {
	var given []string
	for flag, v := range map[string]string{"-redis": c.redisURL, "-redis-cluster": c.cluster, "-sentinel": c.sentinel, "-postgres": c.postgresDSN} {
		if v != "" {
			given = append(given, flag)
		}
	}
	if len(given) != 1 {
		return opened{}, nil, usageError{fmt.Sprintf("name exactly one store (-redis, -redis-cluster, -sentinel or -postgres), got %d", len(given))}
	}
	if c.postgresDSN != "" {
		return c.openPostgres(ctx, migrate)
	}
	client, err := c.redisClient()
	if err != nil {
		return opened{}, nil, usageError{err.Error()}
	}
	if err := client.Ping(ctx).Err(); err != nil {
		client.Close()
		return opened{}, nil, fmt.Errorf("redis: %w", err)
	}
	s, err := idempotency.NewRedisStore(client, idempotency.RedisOptions{Prefix: c.prefix})
	if err != nil {
		client.Close()
		return opened{}, nil, err
	}
	return opened{store: s, inspector: s, stats: s.Stats}, func() { s.Close(); client.Close() }, nil
}

func (c *storeConfig) redisClient() (redis.UniversalClient, error) {
	if c.redisURL != "" {
		return c.standaloneClient()
	}
	tlsConfig, err := c.redisTLS.config(nil)
	if err != nil {
		return nil, err
	}
	if c.cluster != "" {
		return redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(c.cluster, ","), TLSConfig: tlsConfig,
			ContextTimeoutEnabled: true}), nil
	}
	master, addrs, ok := strings.Cut(c.sentinel, "@")
	if !ok || master == "" || addrs == "" {
		return nil, fmt.Errorf("-sentinel: want MASTER@host:port,..., got %q", c.sentinel)
	}
	return redis.NewFailoverClient(&redis.FailoverOptions{MasterName: master, SentinelAddrs: strings.Split(addrs, ","),
		TLSConfig: tlsConfig, ContextTimeoutEnabled: true}), nil
}

// standaloneClient is the client of -redis: over TLS exactly when its URL
// is rediss://, which the TLS flags then configure.
func (c *storeConfig) standaloneClient() (*redis.Client, error) {
	o, err := redis.ParseURL(c.redisURL)
	if err != nil {
		return nil, fmt.Errorf("-redis: %w", err)
	}
	switch {
	case o.TLSConfig == nil && c.redisTLS.given():
		return nil, errors.New("-redis-tls, -redis-ca, -redis-cert and -redis-key need a rediss:// URL in -redis")
	case o.TLSConfig != nil:
		if o.TLSConfig, err = c.redisTLS.config(o.TLSConfig); err != nil {
			return nil, err
		}
	}
	o.ContextTimeoutEnabled = true
	return redis.NewClient(o), nil
}

// given reports whether any TLS flag was set.
func (t redisTLS) given() bool { return t.on || t.ca != "" || t.cert != "" || t.keyf != "" }

// config returns base (go-redis's from a rediss:// URL, which names the
// server) with the flags' CA and client certificate, or for base nil, a
// new configuration when a flag asks for TLS and nil otherwise. Without
// -redis-ca the system's CAs verify the server.
func (t redisTLS) config(base *tls.Config) (*tls.Config, error) {
	if base == nil && !t.given() {
		return nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if base != nil {
		cfg = base.Clone()
	}
	if t.ca != "" {
		pem, err := os.ReadFile(t.ca)
		if err != nil {
			return nil, fmt.Errorf("-redis-ca: %w", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("-redis-ca: no PEM certificate in %s", t.ca)
		}
	}
	if (t.cert == "") != (t.keyf == "") {
		return nil, errors.New("-redis-cert and -redis-key go together")
	}
	if t.cert != "" {
		cert, err := tls.LoadX509KeyPair(t.cert, t.keyf)
		if err != nil {
			return nil, fmt.Errorf("-redis-cert, -redis-key: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

func (c *storeConfig) openPostgres(ctx context.Context, migrate bool) (opened, func(), error) {
	pool, err := pgxpool.New(ctx, c.postgresDSN)
	if err != nil {
		return opened{}, nil, usageError{fmt.Sprintf("-postgres: %v", err)}
	}
	s := postgres.New(pool, postgres.Options{Table: c.table})
	closeAll := func() { s.Close(); pool.Close() }
	o := opened{store: s, inspector: s, stats: s.Stats, deleteExpired: s.DeleteExpired}
	if migrate {
		if err := s.Migrate(ctx); err != nil {
			closeAll()
			return opened{}, nil, err
		}
		return o, closeAll, nil
	}
	// A table that is not there is a wrong -table, or a database the
	// library never migrated: say so rather than fail every read.
	table := c.table
	if table == "" {
		table = "idempotency_records"
	}
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL AND to_regprocedure($2) IS NOT NULL`,
		table, table+"_claim(text, text, bytea, text, bigint, bigint, boolean)").Scan(&exists); err != nil {
		closeAll()
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			return opened{}, nil, fmt.Errorf("postgres: %s", pgErr.Message)
		}
		return opened{}, nil, fmt.Errorf("postgres: %w", err)
	}
	if !exists {
		closeAll()
		return opened{}, nil, fmt.Errorf("postgres: no idempotency table %q with its claim function here: is -table the service's, and has it run Migrate?", table)
	}
	return o, closeAll, nil
}
