from chatrl.step3_ppo.main import main

main()
