package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
)

type settings struct {
	dir, bin          string
	nodes             []string
	tolerationSeconds int
	graceSeconds      int
}

// readyWithin bounds the apiserver's start: its first start migrates storage and installs
// every built-in object, which on two loaded cores takes tens of seconds.
const readyWithin = 3 * time.Minute

func freePort() (int, error) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer listener.Close()
	return listener.Addr().(*net.TCPAddr).Port, nil
}

func up(ctx context.Context, s settings) error {
	pki := filepath.Join(s.dir, "pki")
	logs := filepath.Join(s.dir, "logs")
	for _, d := range []string{pki, logs, filepath.Join(s.dir, "nodes")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	_ = os.Remove(filepath.Join(s.dir, "ready"))
	port, err := freePort()
	if err != nil {
		return err
	}
	server := "https://127.0.0.1:" + strconv.Itoa(port)
	if err := makePKI(s, pki, server); err != nil {
		return fmt.Errorf("making the PKI: %w", err)
	}
	etcd, endpoint, err := startEtcd(filepath.Join(s.dir, "etcd"))
	if err != nil {
		return fmt.Errorf("starting etcd: %w", err)
	}
	defer etcd.Close()
	if err := os.WriteFile(filepath.Join(s.dir, "etcd.endpoint"), []byte(endpoint), 0o644); err != nil {
		return err
	}

	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// SIGUSR1 restarts kube-apiserver, as an upgrade does: every watch is cut, and its
	// fresh watch cache starts at etcd's current revision.
	restart := make(chan os.Signal, 1)
	signal.Notify(restart, syscall.SIGUSR1)
	exited := make(chan error, 3)
	apiserverArgs := apiserverArgs(s, pki, port, endpoint)
	apiserver, err := start(s.bin, logs, "kube-apiserver", apiserverArgs, exited)
	if err != nil {
		return err
	}
	defer func() { halt(apiserver) }()
	if err := waitReady(ctx, pki, server, exited); err != nil {
		return err
	}
	if err := writeGeneration(s.dir, 1); err != nil {
		return err
	}
	manager, err := start(s.bin, logs, "kube-controller-manager", managerArgs(s, pki), exited)
	if err != nil {
		return err
	}
	defer halt(manager)
	scheduler, err := start(s.bin, logs, "kube-scheduler", schedulerArgs(s), exited)
	if err != nil {
		return err
	}
	defer halt(scheduler)
	if err := os.WriteFile(filepath.Join(s.dir, "ready"), []byte(server+"\n"), 0o644); err != nil {
		return err
	}
	fmt.Println(server)
	for generation := 2; ; generation++ {
		select {
		case <-ctx.Done():
			return nil
		case err := <-exited:
			return err
		case <-restart:
			halt(apiserver)
			apiserver, err = start(s.bin, logs, "kube-apiserver", apiserverArgs, exited)
			if err != nil {
				return err
			}
			if err := waitReady(ctx, pki, server, exited); err != nil {
				return err
			}
			if err := writeGeneration(s.dir, generation); err != nil {
				return err
			}
		}
	}
}

// writeGeneration records how many times kube-apiserver has come up ready, in
// DIR/apiserver.generation, for a test that restarts it.
func writeGeneration(dir string, generation int) error {
	return os.WriteFile(filepath.Join(dir, "apiserver.generation"), []byte(strconv.Itoa(generation)+"\n"), 0o644)
}

func makePKI(s settings, pki, server string) error {
	ca, err := newAuthority(pki)
	if err != nil {
		return err
	}
	hosts := []string{"127.0.0.1", "localhost", "10.96.0.1", "kubernetes", "kubernetes.default",
		"kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}
	clients := []struct {
		name, user string
		groups     []string
	}{
		{"apiserver-kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"}},
		{"admin", "harvest-admin", []string{"system:masters"}},
		{"controller-manager", "system:kube-controller-manager", nil},
		{"scheduler", "system:kube-scheduler", nil},
	}
	if err := ca.issue(pki, "apiserver", "kube-apiserver", nil, hosts); err != nil {
		return err
	}
	for _, c := range clients {
		if err := ca.issue(pki, c.name, c.user, c.groups, nil); err != nil {
			return err
		}
	}
	if err := writeServiceAccountKey(pki); err != nil {
		return err
	}
	kubeconfigs := map[string]string{
		filepath.Join(s.dir, "kubeconfig"):              "admin",
		filepath.Join(s.dir, "controller-manager.conf"): "controller-manager",
		filepath.Join(s.dir, "scheduler.conf"):          "scheduler",
	}
	for _, node := range s.nodes {
		name := "node-" + node
		if err := ca.issue(pki, name, "system:node:"+node, []string{"system:nodes"}, nil); err != nil {
			return err
		}
		kubeconfigs[filepath.Join(s.dir, "nodes", node+".kubeconfig")] = name
		// The node agent's kubelet API (pods/log), reached at the node's InternalIP.
		if err := ca.issue(pki, name+"-serving", "system:node:"+node, []string{"system:nodes"},
			[]string{"127.0.0.1", node}); err != nil {
			return err
		}
	}
	for path, name := range kubeconfigs {
		if err := writeKubeconfig(path, pki, server, name); err != nil {
			return err
		}
	}
	return nil
}

func startEtcd(dir string) (*embed.Etcd, string, error) {
	if err := os.RemoveAll(dir); err != nil {
		return nil, "", err
	}
	clientPort, err := freePort()
	if err != nil {
		return nil, "", err
	}
	peerPort, err := freePort()
	if err != nil {
		return nil, "", err
	}
	cfg := embed.NewConfig()
	cfg.Dir = dir
	cfg.LogLevel = "error"
	client, _ := url.Parse("http://127.0.0.1:" + strconv.Itoa(clientPort))
	peer, _ := url.Parse("http://127.0.0.1:" + strconv.Itoa(peerPort))
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*client}, []url.URL{*client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*peer}, []url.URL{*peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	etcd, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, "", err
	}
	select {
	case <-etcd.Server.ReadyNotify():
	case <-time.After(time.Minute):
		etcd.Close()
		return nil, "", errors.New("etcd was not ready within a minute")
	}
	return etcd, client.String(), nil
}

func apiserverArgs(s settings, pki string, port int, etcd string) []string {
	p := func(name string) string { return filepath.Join(pki, name) }
	toleration := strconv.Itoa(s.tolerationSeconds)
	return []string{
		"--etcd-servers=" + etcd,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(port),
		"--cert-dir=" + pki,
		"--tls-cert-file=" + p("apiserver.crt"), "--tls-private-key-file=" + p("apiserver.key"),
		"--client-ca-file=" + p("ca.crt"),
		"--kubelet-client-certificate=" + p("apiserver-kubelet-client.crt"),
		"--kubelet-client-key=" + p("apiserver-kubelet-client.key"),
		// Node agents listen on loopback; their names resolve nowhere.
		"--kubelet-preferred-address-types=InternalIP",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + p("sa.pub"),
		"--service-account-signing-key-file=" + p("sa.key"),
		"--service-cluster-ip-range=10.96.0.0/16",
		"--authorization-mode=Node,RBAC",
		// On by default besides these: ServiceAccount, PodSecurity, LimitRanger,
		// ResourceQuota, DefaultTolerationSeconds, Priority, and the webhooks.
		"--enable-admission-plugins=NodeRestriction",
		// Webhooks (Kueue's, on the Kueue test) are reached at their Service's endpoints:
		// there is no kube-proxy to route a ClusterIP.
		"--enable-aggregator-routing=true",
		"--default-not-ready-toleration-seconds=" + toleration,
		"--default-unreachable-toleration-seconds=" + toleration,
		"--allow-privileged=false",
		"--profiling=false",
		"--v=1",
	}
}

func managerArgs(s settings, pki string) []string {
	conf := filepath.Join(s.dir, "controller-manager.conf")
	return []string{
		"--kubeconfig=" + conf,
		"--authentication-kubeconfig=" + conf, "--authorization-kubeconfig=" + conf,
		"--bind-address=127.0.0.1", "--secure-port=0",
		"--leader-elect=false",
		"--use-service-account-credentials=true",
		"--root-ca-file=" + filepath.Join(pki, "ca.crt"),
		"--service-account-private-key-file=" + filepath.Join(pki, "sa.key"),
		"--cluster-signing-cert-file=" + filepath.Join(pki, "ca.crt"),
		"--cluster-signing-key-file=" + filepath.Join(pki, "ca.key"),
		"--node-monitor-period=2s",
		"--node-monitor-grace-period=" + strconv.Itoa(s.graceSeconds) + "s",
		"--controllers=*",
		"--v=1",
	}
}

func schedulerArgs(s settings) []string {
	conf := filepath.Join(s.dir, "scheduler.conf")
	return []string{
		"--kubeconfig=" + conf,
		"--authentication-kubeconfig=" + conf, "--authorization-kubeconfig=" + conf,
		"--bind-address=127.0.0.1", "--secure-port=0",
		"--leader-elect=false",
		"--v=1",
	}
}

// component is one running child process; done closes when it has exited.
type component struct {
	cmd      *exec.Cmd
	done     chan struct{}
	stopping atomic.Bool
}

// start runs one component with its output in LOGS/NAME.log; its exit is sent on exited.
func start(bin, logs, name string, args []string, exited chan<- error) (*component, error) {
	// Appended to: a restarted component keeps its earlier log.
	log, err := os.OpenFile(filepath.Join(logs, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(filepath.Join(bin, name), args...)
	cmd.Stdout, cmd.Stderr = log, log
	// Children die with this process even if it is killed outright.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	c := &component{cmd: cmd, done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		log.Close()
		close(c.done)
		if c.stopping.Load() {
			return
		}
		select {
		case exited <- fmt.Errorf("%s exited (%v); see %s", name, err, log.Name()):
		default:
		}
	}()
	return c, nil
}

// halt stops a component: SIGTERM, then SIGKILL after ten seconds.
func halt(c *component) {
	c.stopping.Store(true)
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(10 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}

// waitReady polls /readyz as the admin until it answers 200.
func waitReady(ctx context.Context, pki, server string, exited <-chan error) error {
	cert, err := tls.LoadX509KeyPair(filepath.Join(pki, "admin.crt"), filepath.Join(pki, "admin.key"))
	if err != nil {
		return err
	}
	caPEM, err := os.ReadFile(filepath.Join(pki, "ca.crt"))
	if err != nil {
		return err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(caPEM)
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{cert}},
	}}
	deadline := time.Now().Add(readyWithin)
	for time.Now().Before(deadline) {
		if response, err := client.Get(server + "/readyz"); err == nil {
			response.Body.Close()
			if response.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case err := <-exited:
			return err
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
	return fmt.Errorf("kube-apiserver was not ready within %s", readyWithin)
}

// compact compacts etcd to its current revision, so that every watch or list from an older
// resourceVersion is answered 410 Gone.
func compact(dir string) error {
	endpoint, err := os.ReadFile(filepath.Join(dir, "etcd.endpoint"))
	if err != nil {
		return err
	}
	client, err := clientv3.New(clientv3.Config{
		Endpoints: []string{string(endpoint)}, DialTimeout: 10 * time.Second,
	})
	if err != nil {
		return err
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	status, err := client.Get(ctx, "compact-probe")
	if err != nil {
		return err
	}
	revision := status.Header.Revision
	if _, err := client.Compact(ctx, revision, clientv3.WithCompactPhysical()); err != nil {
		return err
	}
	fmt.Println(revision)
	return nil
}
