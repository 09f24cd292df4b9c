// Command harvest-controlplane runs a real Kubernetes control plane on loopback for harvest's
// real-tier tests: etcd (embedded), kube-apiserver, kube-controller-manager and kube-scheduler,
// built from the k8s.io/kubernetes release this module pins. It makes a fresh PKI and
// ServiceAccount signing key at every start, turns on RBAC, Node authorization, NodeRestriction
// and Pod Security admission as on a real cluster, and writes kubeconfigs for an admin and for
// each node agent. Nodes and their Pods are the node agent's (harvest-node-agent); this
// program has none.
//
//	harvest-controlplane up --dir DIR --bin BIN [--node NAME]...   # runs until SIGTERM
//	harvest-controlplane compact --dir DIR                          # etcd compaction, now
//
// `up` writes DIR/kubeconfig (cluster-admin), DIR/nodes/NAME.kubeconfig, and DIR/ready once
// the apiserver is ready. Logs of each component are DIR/logs/*.log. SIGUSR1 restarts
// kube-apiserver; DIR/apiserver.generation counts its ready starts.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
)

type nodeList []string

func (n *nodeList) String() string     { return strings.Join(*n, ",") }
func (n *nodeList) Set(v string) error { *n = append(*n, v); return nil }

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: harvest-controlplane up|compact --dir DIR [...]")
		os.Exit(2)
	}
	flags := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	dir := flags.String("dir", "", "state directory (PKI, etcd data, kubeconfigs, logs)")
	var err error
	switch os.Args[1] {
	case "up":
		bin := flags.String("bin", "", "directory holding kube-apiserver, kube-controller-manager and kube-scheduler")
		tolerationSeconds := flags.Int("unreachable-toleration-seconds", 15,
			"how long a Pod stays on a NotReady or unreachable node before its eviction")
		graceSeconds := flags.Int("node-monitor-grace-seconds", 12,
			"how long a node may miss heartbeats before it is marked NotReady")
		var nodes nodeList
		flags.Var(&nodes, "node", "a node agent's name to issue credentials for (repeatable)")
		_ = flags.Parse(os.Args[2:])
		if *dir == "" || *bin == "" {
			fmt.Fprintln(os.Stderr, "harvest-controlplane up: --dir and --bin are required")
			os.Exit(2)
		}
		err = up(context.Background(), settings{
			dir: *dir, bin: *bin, nodes: nodes,
			tolerationSeconds: *tolerationSeconds, graceSeconds: *graceSeconds,
		})
	case "compact":
		_ = flags.Parse(os.Args[2:])
		err = compact(*dir)
	default:
		err = fmt.Errorf("unknown command %q: use up or compact", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "harvest-controlplane:", err)
		os.Exit(1)
	}
}
