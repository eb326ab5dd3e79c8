package postgres

import (
	_ "embed"
	"strings"
	"text/template"
)

//go:embed statements.sql
var statementsSQL string

//go:embed schema.sql
var schemaSQL string

// schemaTemplate holds schema.sql and the statements it shares with the
// Store (statements.sql).
var schemaTemplate = func() *template.Template {
	t := template.Must(template.New("schema.sql").Option("missingkey=error").Parse(schemaSQL))
	template.Must(t.New("statements.sql").Parse(statementsSQL))
	return t
}()

// params names the parameters of one rendering of a statement of
// statements.sql: $1, $2, … in a statement the Store prepares, the
// function's parameters in schema.sql. A statement uses only some of them.
type params struct {
	Scope, Key, Token               string
	Fingerprint, OperationID, Watch string
	LeaseUS, RetentionUS            string
	Response, Entry, InTx           string
}

// stmt is what a statement of statements.sql is rendered with.
type stmt struct {
	names
	params
}

// fnParams are the parameters of the functions of schema.sql.
var fnParams = params{Scope: "p_scope", Key: "p_key", Token: "p_token",
	LeaseUS: "p_lease_us", RetentionUS: "p_retention_us",
	Response: "p_response", Entry: "p_entry", InTx: "p_in_tx"}

// Fn is n with the parameters of the functions of schema.sql, for the
// statements rendered into their bodies.
func (n names) Fn() stmt { return stmt{n, fnParams} }

// Old is n with the key of the row a trigger function is given.
func (n names) Old() stmt { return stmt{n, params{Scope: "OLD.scope", Key: "OLD.key"}} }

// ownerParams are the parameters of an owner's statement (see prepared.go):
// the key and the token, then the statement's own, from $4.
func ownerParams(rest func(p *params)) params {
	p := params{Scope: "$1", Key: "$2", Token: "$3"}
	rest(&p)
	return p
}

// render renders the statement name of statements.sql for n with p.
func render(n names, name string, p params) string {
	var b strings.Builder
	if err := schemaTemplate.ExecuteTemplate(&b, name, stmt{n, p}); err != nil {
		panic("postgres: rendering " + name + ": " + err.Error()) // a bug of statements.sql
	}
	return b.String()
}
